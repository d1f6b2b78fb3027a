"""Stock KDA decode Triton kernels (`kimi_decode.stock.triton_kda`) against `reference.kda` (§4.2 eq. 3-8).

On a CPU machine the kernels run under Triton's interpreter (conftest sets
TRITON_INTERPRET=1); on a GPU the same tests run compiled. Shapes are small
(2-6 heads, D = 128 or the tiny config's D = 16) to keep the interpreter fast.
"""

import pytest
import torch

from kimi_decode.accuracy import all_written, rel_err
from kimi_decode.config import KimiK3Config, ShardSpec
from kimi_decode.reference import kda as K
from kimi_decode.reference.common import linear
from kimi_decode.reference.precision import Storage, f32
from kimi_decode.state import make_kda_state
from kimi_decode.stock import triton_kda as TK
from kimi_decode.weights import make_layer_weights

# σ(x) = 1/(1+e^-x) overflows e^-x to inf for very negative x under the interpreter (numpy); the result is exact 0
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF = Storage.BF16

# (config overrides, tp): D = 128 with 2 heads, D = 16 with 4 heads, D = 16 with 6 heads (the TP16 head count)
D128 = (dict(kda_head_dim=128, kda_f_rank=128), 4)
D16 = ({}, 2)
D16_H6 = (dict(kda_num_heads=12), 2)


class Case:
    """Weights, state and one step's inputs (z from a real in_proj GEMM of random x)."""

    def __init__(self, spec, batch, T, seed=0, null=()):
        over, tp = spec
        self.cfg = KimiK3Config.tiny(**over)
        sh = ShardSpec(tp=tp, cfg=self.cfg)
        self.w = make_layer_weights("kda_moe", sh, seed=seed).kda
        self.st = make_kda_state(self.cfg, sh, batch, seed=seed, null_slots=null)
        self.T, self.B = T, batch
        self.H, self.D, self.P = self.w.heads, self.w.head_dim, self.w.proj
        self.N = batch * T
        g = torch.Generator().manual_seed(1000 + seed)
        self.x = torch.randn(self.N, self.cfg.hidden_size, generator=g).to(torch.bfloat16)
        sec = self.w.in_proj_sections()
        z = linear(self.x, self.w.in_proj, BF)
        self.z = z.to(torch.bfloat16)
        self.g_raw = linear(self.z[:, sec["f_a"]], self.w.f_b, BF).to(torch.bfloat16)

    # ---- device copies of everything a kernel reads
    def args(self):
        w, st = self.w, self.st
        return dict(z=self.z.to(DEV), g_raw=self.g_raw.to(DEV), conv_w=w.conv1d.to(DEV),
                    A_log=w.A_log.to(DEV), dt_bias=w.dt_bias.to(DEV), o_norm_w=f32(w.o_norm).to(DEV),
                    conv_state=st.conv.clone().to(DEV), rec_state=st.recurrent.clone().to(DEV),
                    slots=st.slots.to(DEV))

    def nan(self, cols):
        return torch.full((self.N, cols), float("nan"), dtype=torch.bfloat16, device=DEV)

    def reference(self):
        """Step-by-step reference (bf16 storage points, as the stock kernels store):
        (u [N, 3P], o [N, P] pre-norm, y [N, P], new state)."""
        w, cfg, sec = self.w, self.cfg, self.w.in_proj_sections()
        new = self.st.clone()
        u_all = torch.zeros(self.N, 3 * self.P)
        o_all = torch.zeros(self.N, self.P)
        y = torch.zeros(self.N, self.P)
        for b in range(self.B):
            slot = int(new.slots[b])
            if slot <= 0:
                continue
            win, S = f32(new.conv[slot]), new.recurrent[slot].clone()
            for t in range(self.T):
                i = b * self.T + t
                u, win = K.conv_step(win, self.z[i, sec["qkv"]], w.conv1d, BF)
                g = K.gates(u, self.g_raw[i], self.z[i, sec["b"]], w, cfg)
                o, S = K.recurrent_step(S, g)
                y[i] = K.gated_output(o, self.z[i, sec["g_out"]], w, cfg, BF)
                u_all[i], o_all[i] = u, o.reshape(-1)
            new.conv[slot] = win.to(new.conv.dtype)
            new.recurrent[slot] = S
        return u_all, o_all, y, new

    def fused(self, a, workspace=None):
        y = self.nan(self.P)
        TK.fused_kda_decode(y, a["z"], a["g_raw"], a["conv_w"], a["A_log"], a["dt_bias"], a["o_norm_w"],
                            a["conv_state"], a["rec_state"], a["slots"], self.T, self.H,
                            lower_bound=self.cfg.gate_lower_bound, qk_eps=self.cfg.kda_qk_norm_eps,
                            o_eps=self.cfg.kda_o_norm_eps, f_rank=self.cfg.kda_f_rank, workspace=workspace)
        return y

    def four_launch(self, a):
        u, o, y = self.nan(3 * self.P), self.nan(self.P), self.nan(self.P)
        TK.causal_conv1d_update(u, a["z"], a["conv_w"], a["conv_state"], a["slots"], self.T)
        TK.fused_recurrent_kda(o, u, a["g_raw"], a["z"], a["A_log"], a["dt_bias"], a["rec_state"], a["slots"],
                               self.T, self.H, lower_bound=self.cfg.gate_lower_bound,
                               qk_eps=self.cfg.kda_qk_norm_eps, f_rank=self.cfg.kda_f_rank)
        core = o.clone()  # stands in for the caller's copy_ into core_attn_out
        TK.rmsnorm_gated(y, core, a["z"], a["o_norm_w"], self.H, eps=self.cfg.kda_o_norm_eps)
        return u, o, y


def _active_tokens(c):
    m = torch.zeros(c.N, dtype=torch.bool)
    for b in range(c.B):
        if int(c.st.slots[b]) > 0:
            m[b * c.T:(b + 1) * c.T] = True
    return m


def _check_outputs(c, y, ref_y, tol=1e-2):
    assert all_written(y)
    y = y.cpu().float()
    act = _active_tokens(c)
    assert rel_err(y[act], ref_y[act]) < tol
    assert torch.all(y[~act] == 0)


def _check_state(c, a, ref):
    assert torch.equal(a["conv_state"].cpu(), ref.conv)  # copies of bf16 inputs: exact
    rec = a["rec_state"].cpu()
    assert rel_err(rec, ref.recurrent) < 1e-5
    untouched = [s for s in range(rec.shape[0]) if s not in {int(v) for v in c.st.slots if int(v) > 0}]
    for s in untouched:  # the null slot 0 and unused slots keep their bits
        assert torch.equal(rec[s], c.st.recurrent[s])
        assert torch.equal(a["conv_state"][s].cpu(), c.st.conv[s])


CASES = [
    pytest.param(D128, 1, 1, (), id="D128-H2-B1-T1"),
    pytest.param(D128, 3, 3, (1,), id="D128-H2-B3null-T3"),
    pytest.param(D16, 3, 3, (0,), id="D16-H4-B3null-T3"),
    pytest.param(D16_H6, 1, 3, (), id="D16-H6-B1-T3"),
]


@pytest.mark.parametrize("split", [False, True], ids=["per-head", "v-split"])
@pytest.mark.parametrize("spec,batch,T,null", CASES)
def test_fused_matches_reference(spec, batch, T, null, split):
    c = Case(spec, batch, T, seed=batch * 10 + T, null=null)
    _, _, ref_y, ref_st = c.reference()
    a = c.args()
    ws = TK.make_fused_workspace(batch + 1, c.H, DEV) if split else None
    for step in range(2 if split else 1):  # the workspace is left zeroed: a second call works too
        if step:
            c.st = ref_st
            _, _, ref_y, ref_st = c.reference()
        y = c.fused(a, ws)
        _check_outputs(c, y, ref_y)
        _check_state(c, a, ref_st)
        if split:
            assert int(ws.abs().sum()) == 0


def test_fused_kernels_agree():
    """The V-split kernel (with a workspace) and the per-head kernel agree (bit-equal on the H200)."""
    c = Case(D128, 2, 2, seed=21)
    a1, a2 = c.args(), c.args()
    y1 = c.fused(a1)
    y2 = c.fused(a2, TK.make_fused_workspace(2, c.H, DEV))
    assert rel_err(y1.cpu().float(), y2.cpu().float()) < 1e-2
    assert torch.equal(a1["conv_state"], a2["conv_state"])
    assert rel_err(a1["rec_state"].cpu(), a2["rec_state"].cpu()) < 1e-6


@pytest.mark.parametrize("spec,batch,T,null", CASES)
def test_four_launch_path_matches_reference_and_fused(spec, batch, T, null):
    c = Case(spec, batch, T, seed=batch * 10 + T + 1, null=null)
    ref_u, ref_o, ref_y, ref_st = c.reference()
    a4, af = c.args(), c.args()
    u, o, y4 = c.four_launch(a4)
    act = _active_tokens(c)
    assert all_written(u) and all_written(o)
    assert rel_err(u.cpu().float()[act], ref_u[act]) < 1e-2
    assert rel_err(o.cpu().float()[act], ref_o[act]) < 1e-2
    assert torch.all(u.cpu()[~act] == 0) and torch.all(o.cpu()[~act] == 0)
    _check_outputs(c, y4, ref_y)
    _check_state(c, a4, ref_st)
    yf = c.fused(af)
    assert rel_err(y4.cpu().float()[act], yf.cpu().float()[act]) < 1e-2
    assert torch.equal(y4.cpu()[~act], yf.cpu()[~act])
    assert torch.equal(a4["conv_state"], af["conv_state"])
    assert rel_err(a4["rec_state"].cpu(), af["rec_state"].cpu()) < 1e-6


def test_fused_equals_reference_layer_end_to_end():
    """y from the kernel through o_proj equals `reference.kda.kda_decode` (with bf16 storage)."""
    c = Case(D16, 2, 2, seed=7, null=(1,))
    ref_out, ref_st = K.kda_decode(c.x, c.w, c.st, c.T, c.cfg, BF)
    a = c.args()
    y = c.fused(a)
    out = linear(y.cpu(), c.w.o_proj, BF)
    act = _active_tokens(c)
    assert rel_err(out[act], ref_out[act]) < 1e-2
    assert torch.all(out[~act] == 0)
    _check_state(c, a, ref_st)


def test_int32_slots_and_strided_z():
    """slots may be int32; z may be a row-strided view (only its last dim must be unit-stride)."""
    c = Case(D16, 2, 1, seed=3)
    ref_u, _, ref_y, ref_st = c.reference()
    a = c.args()
    a["slots"] = a["slots"].to(torch.int32)
    wide = torch.zeros(c.N, a["z"].shape[1] + 16, dtype=torch.bfloat16, device=DEV)
    wide[:, :a["z"].shape[1]] = a["z"]
    a["z"] = wide[:, :a["z"].shape[1]]
    y = c.fused(a)
    _check_outputs(c, y, ref_y)
    _check_state(c, a, ref_st)


def test_sequential_steps_chain():
    """Two T=1 calls equal one T=2 call (the final state carries between steps)."""
    c = Case(D16, 1, 2, seed=5)
    a2 = c.args()
    y2 = c.fused(a2)
    a1 = c.args()
    for t in range(2):
        y = torch.full((1, c.P), float("nan"), dtype=torch.bfloat16, device=DEV)
        TK.fused_kda_decode(y, a1["z"][t:t + 1], a1["g_raw"][t:t + 1], a1["conv_w"], a1["A_log"],
                            a1["dt_bias"], a1["o_norm_w"], a1["conv_state"], a1["rec_state"], a1["slots"],
                            1, c.H, f_rank=c.cfg.kda_f_rank)
        assert rel_err(y.cpu().float(), y2[t:t + 1].cpu().float()) < 1e-2
    assert torch.equal(a1["conv_state"], a2["conv_state"])
    assert rel_err(a1["rec_state"].cpu(), a2["rec_state"].cpu()) < 1e-6


# ------------------------------------------------------------------ bad inputs


def _bad_cases():
    """(description, mutate(args, outs) -> None) pairs, each must raise before launch."""
    def set_(key, fn):
        return lambda a: a.__setitem__(key, fn(a[key]))
    return [
        ("y dtype", set_("y", lambda t: t.float())),
        ("y shape", set_("y", lambda t: t[:, :-1])),
        ("g_raw shape", set_("g_raw", lambda t: t[:-1])),
        ("z too narrow", set_("z", lambda t: t[:, :100])),
        ("z dtype", set_("z", lambda t: t.float())),
        ("conv_w dtype", set_("conv_w", lambda t: t.to(torch.bfloat16))),
        ("conv_w shape", set_("conv_w", lambda t: t[:, :3].contiguous())),
        ("A_log shape", set_("A_log", lambda t: t[:-1])),
        ("dt_bias dtype", set_("dt_bias", lambda t: t.double())),
        ("o_norm_w dtype (bf16)", set_("o_norm_w", lambda t: t.to(torch.bfloat16))),
        ("conv_state dtype", set_("conv_state", lambda t: t.float())),
        ("conv_state DS layout", set_("conv_state", lambda t: t.transpose(1, 2).contiguous())),
        ("rec_state dtype", set_("rec_state", lambda t: t.to(torch.bfloat16))),
        ("rec_state transposed", set_("rec_state", lambda t: t.transpose(2, 3))),
        ("slots dtype", set_("slots", lambda t: t.float())),
        ("slots count", set_("slots", lambda t: t[:1])),
        ("device mix", set_("y", lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))),
        ("workspace dtype", set_("workspace", lambda t: t.long())),
        ("workspace too small", set_("workspace", lambda t: t[:1])),
    ]


@pytest.mark.parametrize("what,mutate", _bad_cases(), ids=[d for d, _ in _bad_cases()])
def test_fused_bad_inputs_raise_before_launch(what, mutate):
    c = Case(D16, 2, 1, seed=11)
    a = c.args()
    a["y"] = c.nan(c.P)
    a["workspace"] = TK.make_fused_workspace(c.B, c.H, DEV) if what.startswith("workspace") else None
    mutate(a)
    conv0, rec0 = a["conv_state"].clone(), a["rec_state"].clone()
    with pytest.raises(ValueError):
        TK.fused_kda_decode(a["y"], a["z"], a["g_raw"], a["conv_w"], a["A_log"], a["dt_bias"], a["o_norm_w"],
                            a["conv_state"], a["rec_state"], a["slots"], c.T, c.H, f_rank=c.cfg.kda_f_rank,
                            workspace=a["workspace"])
    if a["y"].device.type != "meta" and a["y"].dtype == torch.bfloat16 and a["y"].numel():
        assert torch.isnan(a["y"].float()).all()  # nothing was launched
    assert torch.equal(a["conv_state"], conv0) and torch.equal(a["rec_state"], rec0)


def test_bad_geometry_raises():
    c = Case(D16, 2, 1, seed=12)
    a = c.args()
    y = c.nan(c.P)
    call = lambda T, H: TK.fused_kda_decode(y, a["z"], a["g_raw"], a["conv_w"], a["A_log"], a["dt_bias"],
                                            a["o_norm_w"], a["conv_state"], a["rec_state"], a["slots"], T, H,
                                            f_rank=c.cfg.kda_f_rank)
    with pytest.raises(ValueError, match="tokens"):
        call(2, c.H)  # N = 2 tokens for 2 sequences x 2
    with pytest.raises(ValueError, match="tokens_per_seq"):
        call(0, c.H)
    with pytest.raises(ValueError, match="rec_state"):
        call(1, c.H + 1)
    assert torch.isnan(y.float()).all()


def test_split_path_bad_inputs_raise():
    c = Case(D16, 2, 1, seed=13)
    a = c.args()
    u, o, y = c.nan(3 * c.P), c.nan(c.P), c.nan(c.P)
    with pytest.raises(ValueError, match="u must be"):
        TK.causal_conv1d_update(u[:, :-1], a["z"], a["conv_w"], a["conv_state"], a["slots"], c.T)
    with pytest.raises(ValueError, match="conv_w"):
        TK.causal_conv1d_update(u, a["z"], a["conv_w"][:c.P], a["conv_state"], a["slots"], c.T)
    with pytest.raises(ValueError, match="tokens"):
        TK.causal_conv1d_update(u, a["z"], a["conv_w"], a["conv_state"], a["slots"][:1], c.T)
    with pytest.raises(ValueError, match="o must"):
        TK.fused_recurrent_kda(o.float(), u, a["g_raw"], a["z"], a["A_log"], a["dt_bias"], a["rec_state"],
                               a["slots"], c.T, c.H, f_rank=c.cfg.kda_f_rank)
    with pytest.raises(ValueError, match="u must"):
        TK.fused_recurrent_kda(o, u[:, :c.P], a["g_raw"], a["z"], a["A_log"], a["dt_bias"], a["rec_state"],
                               a["slots"], c.T, c.H, f_rank=c.cfg.kda_f_rank)
    with pytest.raises(ValueError, match="o_norm_w"):
        TK.rmsnorm_gated(y, o, a["z"], a["o_norm_w"].to(torch.bfloat16), c.H)
    with pytest.raises(ValueError, match="head dim"):
        TK.rmsnorm_gated(y, o, a["z"], a["o_norm_w"][:12], c.H)
    with pytest.raises(ValueError, match="z must"):
        TK.rmsnorm_gated(y, o, a["z"][:, :3 * c.P], a["o_norm_w"], c.H)
    for t in (u, o, y):
        assert torch.isnan(t.float()).all()


@pytest.mark.skipif(DEV != "cpu", reason="CPU tensors are only refused outside the interpreter")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    c = Case(D16, 1, 1, seed=14)
    a = c.args()
    y = c.nan(c.P)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        TK.rmsnorm_gated(y, y.clone(), a["z"], a["o_norm_w"], c.H)
