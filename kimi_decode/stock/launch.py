"""Launch records and the executor that runs a schedule of them.

A schedule is a list of steps. A `Launch` is exactly one kernel launch,
labelled with the vLLM op it stands for and the bytes/FLOPs it must move. A
`Fork` runs its launches on the auxiliary stream (as vLLM overlaps router ‖
down_proj, g_proj ‖ MLA front, shared all-reduce ‖ up_proj); a `Join` makes the
main stream wait for the auxiliary one. On CPU tensors streams are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

import torch


@dataclass
class Launch:
    label: str  # this project's name for the launch, e.g. "kda.in_proj"
    vllm_op: str  # the stock vLLM kernel it stands for
    impl: str  # "cuBLAS", "Triton", "torch" ...
    bytes_read: int
    bytes_written: int
    flops: int
    run: Callable[[], None] = field(repr=False, default=lambda: None)
    stream: str = "main"

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def row(self) -> dict:
        return {"label": self.label, "vllm_op": self.vllm_op, "impl": self.impl, "stream": self.stream,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "flops": self.flops}


@dataclass
class Fork:
    """Launches that run on the auxiliary stream, overlapping the main stream's next launches."""

    launches: list[Launch]

    def __post_init__(self):
        for l in self.launches:
            l.stream = "aux"


@dataclass
class Join:
    """The main stream waits for the auxiliary stream here."""

    reason: str = ""


Step = Union[Launch, Fork, Join]


def launches_of(steps: list[Step]) -> list[Launch]:
    out: list[Launch] = []
    for s in steps:
        if isinstance(s, Launch):
            out.append(s)
        elif isinstance(s, Fork):
            out.extend(s.launches)
    return out


class Executor:
    """Runs steps in order; forks/joins map to a side CUDA stream on GPU tensors."""

    def __init__(self, steps: list[Step], device: torch.device):
        self.steps = steps
        self.device = torch.device(device)
        self._aux = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    def __call__(self) -> None:
        if self._aux is None:
            for s in self.steps:
                if isinstance(s, Launch):
                    s.run()
                elif isinstance(s, Fork):
                    for l in s.launches:
                        l.run()
            return
        main = torch.cuda.current_stream(self.device)
        for s in self.steps:
            if isinstance(s, Launch):
                s.run()
            elif isinstance(s, Fork):
                self._aux.wait_stream(main)
                with torch.cuda.stream(self._aux):
                    for l in s.launches:
                        l.run()
            elif isinstance(s, Join):
                main.wait_stream(self._aux)
