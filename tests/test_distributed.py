"""torch.distributed with the gloo backend on CPU: real TP all-reduce and the DCP merge across processes."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kimi_decode.accuracy import rel_err
from kimi_decode.config import DecodeShape, KimiK3Config, ShardSpec
from kimi_decode.distributed import MULTICAST_OFF, dcp_local_attention, dcp_merge, init, multicast_off_env, tp_allreduce
from kimi_decode.reference.dense import dense_partial
from kimi_decode.reference.mla import insert_rows, query_and_latent
from kimi_decode.state import make_mla_cache
from kimi_decode.weights import make_layer_weights, unshard


def _tp_worker(rank, world, init_method, result_dir):
    init(rank, world, init_method, backend="gloo")
    cfg = KimiK3Config.tiny()
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    w = make_layer_weights("dense", ShardSpec(tp=world, rank=rank, cfg=cfg), seed=9)
    part = dense_partial(x, w.dense, cfg)
    tp_allreduce(part)
    torch.save(part, os.path.join(result_dir, f"tp{rank}.pt"))
    dist.destroy_process_group()


def _dcp_worker(rank, world, init_method, result_dir):
    init(rank, world, init_method, backend="gloo")
    cfg = KimiK3Config.tiny()
    shape = DecodeShape(2, 2, (9, 40))
    w = make_layer_weights("mla_moe", ShardSpec(tp=2, cfg=cfg), seed=3).mla
    cache = make_mla_cache(cfg, shape, seed=3, block_size=16)
    x = torch.randn(shape.num_tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    q = query_and_latent(x, w, cfg)
    q_lat = torch.einsum("nhd,hdl->nhl", q.q_nope, w.W_UK_T.float())
    mqa_q = torch.cat([q_lat, q.q_pe], -1)
    new = insert_rows(cache, q.new_rows, 2)
    ctx = list(shape.context_per_seq)
    # this rank keeps only the rows it owns: positions ≡ rank (mod world)
    local = [new.gather(b, ctx[b] + 2)[rank::world] for b in range(2)]
    o, lse = dcp_local_attention(mqa_q, local, ctx, 2, rank, world, cfg)
    merged = dcp_merge(o, lse)
    torch.save((merged, mqa_q, [new.gather(b, ctx[b] + 2) for b in range(2)]), os.path.join(result_dir, f"dcp{rank}.pt"))
    dist.destroy_process_group()


def _spawn(fn, world, tmp_path):
    init_method = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(fn, args=(world, init_method, str(tmp_path)), nprocs=world, join=True)


@pytest.mark.slow
def test_tp_allreduce_across_processes_equals_unsharded(tmp_path):
    _spawn(_tp_worker, 2, tmp_path)
    cfg = KimiK3Config.tiny()
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    full = unshard([make_layer_weights("dense", ShardSpec(tp=2, rank=r, cfg=cfg), seed=9) for r in range(2)])
    ref = dense_partial(x, full.dense, cfg)
    for r in range(2):
        assert rel_err(torch.load(tmp_path / f"tp{r}.pt"), ref) < 1e-5


@pytest.mark.slow
def test_dcp_merge_across_processes_equals_dcp1(tmp_path):
    from kimi_decode.dcp import mla_attention_dcp
    world = 4
    _spawn(_dcp_worker, world, tmp_path)
    merged, mqa_q, rows = torch.load(tmp_path / "dcp0.pt")
    ref = mla_attention_dcp(mqa_q, rows, [9, 40], 2, 1, KimiK3Config.tiny())
    assert rel_err(merged, ref) < 1e-5
    for r in range(1, world):
        assert torch.equal(torch.load(tmp_path / f"dcp{r}.pt")[0], merged)


def test_multicast_stays_off():
    assert all(os.environ[k] == v for k, v in MULTICAST_OFF.items())
    env = multicast_off_env({"NCCL_NVLS_ENABLE": "1", "PATH": "/bin"})
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["PATH"] == "/bin"


def _stock_worker(rank, world, init_method, result_dir, kind, dcp=1, shape=(2, 1, (3, 50))):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from kimi_decode.distributed import dcp_groups
    from kimi_decode.state import make_decode_state
    from kimi_decode.stock.schedule import StockLayer
    init(rank, world, init_method, backend="gloo")
    cfg = KimiK3Config.tiny()
    sh = ShardSpec(tp=world, rank=rank, dcp=dcp, cfg=cfg)
    shape = DecodeShape(*shape)
    layer = StockLayer(make_layer_weights(kind, sh, seed=6), make_decode_state(kind, sh, shape, seed=6),
                       group=dist.group.WORLD, kda_fused=True, dcp_group=dcp_groups(dcp))
    layer()
    routing = getattr(layer, "routing", None)
    torch.save((layer.h.clone(), routing[0].clone() if routing else None, [l.label for l in layer.launches()]),
               os.path.join(result_dir, f"stock{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("kind,world,dcp,shape", [
    ("dense", 2, 1, (2, 1, (3, 50))),
    ("kda_moe", 2, 1, (2, 1, (3, 50))),
    ("mla_moe", 2, 1, (2, 1, (3, 50))),
    # decode context parallelism: the latent cache sharded by position, the queries all-gathered and the
    # partials exchanged over the DCP group (gloo), merged by log-sum-exp
    ("mla_moe", 2, 2, (2, 2, (3, 50))),
    ("mla_moe", 4, 2, (2, 1, (0, 70))),  # two DCP groups of two TP ranks each
])
def test_stock_schedule_with_real_collectives_equals_the_tp_layer(tmp_path, kind, world, dcp, shape):
    from kimi_decode.accuracy import routing_agreement, within_bf16_rule
    from kimi_decode.reference import Storage, decoder_layer
    from kimi_decode.state import make_decode_state
    mp.spawn(_stock_worker, args=(world, f"file://{tmp_path / 'rdv'}", str(tmp_path), kind, dcp, shape),
             nprocs=world, join=True)
    cfg = KimiK3Config.tiny()
    shape = DecodeShape(*shape)
    specs = ShardSpec(tp=world, dcp=dcp, cfg=cfg).all_ranks()
    ws = [make_layer_weights(kind, s, seed=6) for s in specs]
    sts = [make_decode_state(kind, s, shape, seed=6) for s in specs]
    ref = decoder_layer(ws, [s.clone() for s in sts])
    ref_bf = decoder_layer(ws, [s.clone() for s in sts], storage=Storage.BF16)
    h0, ids0, labels = torch.load(tmp_path / "stock0.pt")
    keep = torch.ones(shape.num_tokens, dtype=torch.bool)
    if ids0 is not None:
        keep, flips, ties = routing_agreement(ids0, ref.x_mlp, ws[0].moe, cfg)
        assert ties
    ok, err, bound = within_bf16_rule(h0[keep].float(), ref.h[keep], ref_bf.h[keep])
    assert ok, (err, bound)
    for r in range(1, world):  # every rank holds the reduced output
        assert torch.equal(torch.load(tmp_path / f"stock{r}.pt")[0], h0)
    dcp_steps = ["mla.dcp_q_allgather", "mla.dcp_exchange", "mla.dcp_merge"]
    assert [l for l in labels if l.startswith("mla.dcp")] == (dcp_steps if dcp > 1 else [])


def test_multi_gpu_launcher_says_what_is_missing_without_gpus(capsys):
    from kimi_decode.multi_gpu import main
    if torch.cuda.is_available():
        pytest.skip("this checks the message on a machine without GPUs")
    assert main(["--out", "unused.csv"]) == 3
    assert "needs CUDA GPUs" in capsys.readouterr().out



def _check_step_worker(rank, world, init_method, result_dir):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from kimi_decode.distributed import dcp_groups
    from kimi_decode.multi_gpu import check_step
    init(rank, world, init_method, backend="gloo")
    sh = ShardSpec(tp=world, rank=rank, dcp=world, cfg=KimiK3Config.tiny())
    checks, h = check_step(make_layer_weights("mla_moe", sh, seed=4), DecodeShape(1, 1, 40), dist.group.WORLD,
                           dcp_groups(world), "cpu")
    torch.save(checks, os.path.join(result_dir, f"check{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_multi_gpu_check_step_runs_with_dcp_on_gloo(tmp_path):
    """The multi-GPU launcher's per-rank check (the part that needs no CUDA graph) on two CPU processes."""
    _spawn(_check_step_worker, 2, tmp_path)
    for r in range(2):
        assert torch.load(tmp_path / f"check{r}.pt") == {"ranks_agree": True, "all_written": True}


def _oneshot_worker(rank, world, init_method, result_dir):
    from kimi_decode.state import make_decode_state
    from kimi_decode.stock.schedule import StockLayer
    init(rank, world, init_method, backend="gloo")
    sh = ShardSpec(tp=world, rank=rank, cfg=KimiK3Config.tiny())
    w = make_layer_weights("dense", sh, seed=1)
    st = make_decode_state("dense", sh, DecodeShape(1, 1, 4), seed=1)
    try:
        StockLayer(w, st, group=dist.group.WORLD, allreduce="oneshot")
        msg = "built"
    except ValueError as e:
        msg = str(e)
    torch.save(msg, os.path.join(result_dir, f"oneshot{rank}.pt"))
    dist.destroy_process_group()


def test_oneshot_allreduce_is_refused_where_it_cannot_run(tmp_path):
    """The one-shot all-reduce needs a process group and CUDA tensors; both are checked before any build."""
    from kimi_decode.state import make_decode_state
    from kimi_decode.stock.schedule import StockLayer
    sh = ShardSpec(tp=2, cfg=KimiK3Config.tiny())
    w, st = make_layer_weights("dense", sh, seed=1), make_decode_state("dense", sh, DecodeShape(1, 1, 4), seed=1)
    with pytest.raises(ValueError, match="needs group"):
        StockLayer(w, st, allreduce="oneshot")
    with pytest.raises(ValueError, match="allreduce must be one of"):
        StockLayer(w, st, allreduce="ring")
    if not torch.cuda.is_available():
        _spawn(_oneshot_worker, 2, tmp_path)
        assert "needs CUDA tensors" in torch.load(tmp_path / "oneshot0.pt")


def test_no_code_reaches_for_nvlink_multicast():
    """Multicast stays off by construction too: no multimem instruction, multicast object or multimem / two-shot
    symmetric-memory collective anywhere in the package or its scripts (the one-shot all-reduce reads peers'
    buffers with ordinary loads)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    banned = ("multimem", "cuMulticast", "two_shot_all_reduce")
    for path in [*root.joinpath("kimi_decode").rglob("*.py"), *root.joinpath("scripts").rglob("*")]:
        if path.is_file():
            text = path.read_text(errors="ignore")
            assert not [b for b in banned if b in text], path
