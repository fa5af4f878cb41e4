"""Reads a compiled HLO module to check the expert-parallel overlaps (SBO).

Two overlaps are arranged by `pallas_moe.nn.expert_parallel`:

1. the shared MLP (named scope `shared_experts`) runs while the dispatch collective
   (`ep_dispatch`) is in flight;
2. with `overlap="chunked"`, chunk c's combine collective (`ep_combine_chunk{c}`) runs
   while chunk c+1's down-proj (`down_proj_chunk{c+1}`; with the all-gather dispatch, the
   chunk's whole expert FFN) computes.

What the compiled module fixes, on every backend, is its dataflow graph: an overlap is
possible exactly when neither side depends on the other. `ep_overlap_report` checks that
on the entry computation (after fusion) and reports where the ops sit in the schedule.
On GPU, XLA splits collectives into async `*-start` / `*-done` pairs and its
latency-hiding scheduler places independent compute between them; the report then says
whether the shared MLP sits between the dispatch's start and done, and whether each
combine starts before the next chunk's down-proj. XLA:CPU runs collectives as single
synchronous ops (no start/done) and overlaps independent work by running its thunks
concurrently, so there the dependency facts are what can be checked.

    compiled = jax.jit(step).lower(*args).compile()
    report = ep_overlap_report(compiled.as_text())
"""

from __future__ import annotations

import dataclasses
import re

from pallas_moe.nn.expert_parallel import DISPATCH_SCOPE, SHARED_SCOPE, combine_scope
from pallas_moe.ops.row_chunks import down_proj_scope

COLLECTIVES = (
    "all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute",
    "ragged-all-to-all", "collective-broadcast",
)


@dataclasses.dataclass(frozen=True)
class HloOp:
    """One instruction of a computation, in schedule order."""

    index: int
    name: str
    opcode: str
    operands: tuple[str, ...]
    op_name: str  # metadata op_name ("" if none)

    @property
    def is_collective(self) -> bool:
        base = self.opcode.removesuffix("-start").removesuffix("-done")
        return base in COLLECTIVES or self.opcode in ("async-start", "async-done")

    @property
    def is_gemm(self) -> bool:
        """A matmul, a kernel call or a loop (the xla backend's tile scan): the compute."""
        if self.opcode in ("dot", "convolution", "custom-call", "while"):
            return True
        return self.opcode == "fusion" and self.op_name.endswith("dot_general")

    @property
    def is_done(self) -> bool:
        return self.opcode.endswith("-done")


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at text[start] == '('."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced parentheses in HLO line: {text[:200]!r}")


def entry_ops(hlo_text: str) -> list[HloOp]:
    """The entry computation's instructions, in the order of the module's schedule."""
    start = hlo_text.find("\nENTRY ")
    if start < 0:
        raise ValueError("hlo_text has no ENTRY computation; pass compiled.as_text().")
    body = hlo_text[start:].split("\n}", 1)[0]
    ops = []
    for line in body.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$", line)
        if not m:
            continue
        name, rhs = m.groups()
        pos = _balanced(rhs, 0) if rhs.startswith("(") else rhs.index(" ")  # skip the type
        rest = rhs[pos:].lstrip()
        paren = rest.index("(")
        opcode = rest[:paren]
        operand_text = rest[paren:_balanced(rest, paren)]
        op_name = re.search(r'op_name="([^"]*)"', line)
        ops.append(HloOp(
            index=len(ops), name=name, opcode=opcode,
            operands=tuple(re.findall(r"%([^\s,()]+)", operand_text)),
            op_name=op_name.group(1) if op_name else "",
        ))
    return ops


def in_scope(op: HloOp, scope: str) -> bool:
    """Whether the op was traced under `jax.named_scope(scope)` (a path component of op_name)."""
    return re.search(rf"(^|[/(]){re.escape(scope)}($|[/)])", op.op_name) is not None


def ancestors(ops: list[HloOp], names: set[str]) -> set[str]:
    """Names of every op that the given ops depend on, transitively (excluding themselves)."""
    by_name = {op.name: op for op in ops}
    seen: set[str] = set()
    stack = [o for n in names for o in by_name[n].operands if o in by_name]
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(o for o in by_name[name].operands if o in by_name)
    return seen


def constant_ops(ops: list[HloOp]) -> set[str]:
    """Names of ops computed from constants only (no parameter upstream).

    XLA shares such ops between scopes (CSE of a broadcast constant keeps one op_name),
    so they create no real ordering and are left out of the dependency checks.
    """
    data: set[str] = set()
    for op in ops:  # the schedule is a topological order
        if op.opcode == "parameter" or any(o in data for o in op.operands):
            data.add(op.name)
    return {op.name for op in ops} - data


def _depends(ops, later: list[HloOp], earlier: list[HloOp]) -> bool:
    """Whether any op of `later` depends (transitively) on a data op of `earlier`."""
    earlier_names = {o.name for o in earlier} - constant_ops(ops)
    return bool(ancestors(ops, {o.name for o in later}) & earlier_names)


def _span(group: list[HloOp]) -> dict:
    """Schedule positions of a group: first/last GEMM (or op); for collectives, start and done."""
    compute = [o for o in group if o.is_gemm] or group
    out = {"first": min(o.index for o in compute), "last": max(o.index for o in compute)}
    collectives = [o for o in group if o.is_collective]
    if collectives:
        out["start"] = min(o.index for o in collectives if not o.is_done)
        out["done"] = max(o.index for o in collectives)
        out["async"] = any(o.is_done for o in collectives)
    return out


def ep_overlap_report(hlo_text: str) -> dict:
    """Dependency and schedule facts of the EP overlaps in a compiled module.

    Args:
      hlo_text: `compiled.as_text()` of a jitted function that calls an expert-parallel
        `MoE` layer (forward; a backward adds transposed ops outside these scopes).

    Returns a dict:
      shared (if the module has shared experts and a dispatch):
        independent: bool, neither the shared MLP nor the dispatch collectives depend on
          each other (the overlap is possible);
        between_start_and_done: bool or None, every GEMM of the shared MLP sits between the
          dispatch's first collective start and its last done (None when the collectives
          are synchronous, as on XLA:CPU);
        shared, dispatch: schedule spans.
      chunks: one entry per chunk boundary c -> c+1 (chunked overlap), each with
        independent (chunk c's combine collectives do not depend on chunk c+1's down-proj
        and vice versa), combine_starts_first (bool: chunk c's combine starts before chunk
        c+1's down-proj's first op) and both spans.
      num_chunks: the number of `down_proj_chunk*` scopes found.
    """
    ops = entry_ops(hlo_text)
    report: dict = {}
    shared = [o for o in ops if in_scope(o, SHARED_SCOPE)]
    dispatch = [o for o in ops if in_scope(o, DISPATCH_SCOPE) and o.is_collective]
    if shared and dispatch:
        d_span = _span(dispatch)
        s_span = _span(shared)
        between = None
        if d_span["async"]:
            between = d_span["start"] < s_span["first"] and s_span["last"] < d_span["done"]
        report["shared"] = {
            "independent": not _depends(ops, shared, dispatch) and not _depends(ops, dispatch, shared),
            "between_start_and_done": between,
            "shared": s_span,
            "dispatch": d_span,
        }
    num_chunks = 0
    while any(in_scope(o, down_proj_scope(num_chunks)) for o in ops):
        num_chunks += 1
    report["num_chunks"] = num_chunks
    report["chunks"] = []
    for c in range(num_chunks - 1):
        combine = [o for o in ops if in_scope(o, combine_scope(c)) and o.is_collective]
        down_next = [o for o in ops if in_scope(o, down_proj_scope(c + 1))]
        if not combine:
            report["chunks"].append({"chunk": c, "independent": False, "error": "no combine collective"})
            continue
        c_span, n_span = _span(combine), _span(down_next)
        report["chunks"].append({
            "chunk": c,
            "independent": not _depends(ops, combine, down_next) and not _depends(ops, down_next, combine),
            "combine_starts_first": c_span["start"] < n_span["first"],
            "combine": c_span,
            "next_down_proj": n_span,
        })
    return report
