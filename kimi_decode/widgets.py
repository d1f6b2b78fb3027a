"""ipywidgets explorers for notebooks (import only where ipywidgets is installed)."""

from __future__ import annotations

from .byte_counts import layer_bytes
from .config import LAYER_KINDS, DecodeShape, ShardSpec
from .support import UnsupportedConfiguration, check_supported


def bytes_explorer():
    """Pick layer, TP, DCP, batch, tokens and context; see the bytes per sub-block and the H200 floor.

    Out-of-matrix choices show the support-matrix error instead of a figure.
    """
    import ipywidgets as W
    import matplotlib.pyplot as plt
    from IPython.display import display

    from .plots import plot_bytes_per_sub_block

    controls = dict(
        layer=W.Dropdown(options=LAYER_KINDS, value="mla_moe", description="layer"),
        tp=W.ToggleButtons(options=[8, 16], value=8, description="TP"),
        dcp=W.ToggleButtons(options=[1, 2, 4, 8], value=1, description="DCP"),
        batch=W.IntSlider(value=1, min=1, max=64, description="batch"),
        tokens=W.IntSlider(value=1, min=1, max=8, description="tokens/seq"),
        context=W.IntText(value=8192, description="context"),
    )

    def show(layer, tp, dcp, batch, tokens, context):
        try:
            check_supported(layer=layer, tp=tp, dcp=dcp, batch=batch, tokens_per_seq=tokens, context=context)
        except UnsupportedConfiguration as e:
            print(e)
            return
        b = layer_bytes(layer, ShardSpec(tp=tp, dcp=dcp), DecodeShape(batch, tokens, context))
        plot_bytes_per_sub_block([b])
        plt.show()
        print(f"streamed {b.streamed:,} B  |  resident {b.resident:,} B  |  floor {b.floor_seconds() * 1e6:.1f} µs")

    out = W.interactive_output(show, controls)
    ui = W.VBox([W.HBox([controls["layer"], controls["context"]]), controls["tp"], controls["dcp"],
                 W.HBox([controls["batch"], controls["tokens"]])])
    box = W.VBox([ui, out])
    display(box)
    return box
