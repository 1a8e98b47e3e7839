"""What scripts and tests read out of a compiled XLA program: its collectives (from the optimized HLO
text), XLA's own per-device memory and cost figures, a census of the optimized module (``Module``:
matmul FLOPs, kernels and collectives per step, loops counted by their trip counts), which the GPU
compile tool reads because XLA:GPU's compile-only programs give no cost analysis, and what that census
leaves out of a GPU module: Pallas kernels' custom calls with their matmul FLOPs from shapes
(``pallas_calls``) and the kernels one step launches (``kernels_launched``)."""

from __future__ import annotations

import collections
import dataclasses
import math
import re

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
_MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
                  "generated_code_size_in_bytes", "host_argument_size_in_bytes", "host_output_size_in_bytes",
                  "host_temp_size_in_bytes", "peak_memory_in_bytes")


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Occurrences of each collective op in optimized HLO text (async ``-start`` forms counted, their
    ``-done`` halves not)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo_text.splitlines():
        for op in COLLECTIVES:
            if f" {op}(" in line or f" {op}-start(" in line:
                counts[op] += 1
    return counts


def memory_of(compiled) -> dict[str, int | None]:
    """Per-device bytes from XLA's ``memory_analysis()``, named ``argument_bytes``, ``temp_bytes``, ...
    (every value None where the backend gives no analysis)."""
    analysis = compiled.memory_analysis()
    names = {field: field.replace("_size_in_bytes", "_bytes").replace("_in_bytes", "_bytes")
             for field in _MEMORY_FIELDS}
    if analysis is None:
        return dict.fromkeys(names.values())
    return {name: getattr(analysis, field, None) for field, name in names.items()}


def footprint_bytes(memory: dict[str, int | None]) -> int:
    """One device's memory for one call of a compiled program (``memory_of``): arguments + outputs -
    the outputs aliasing donated arguments + temporaries."""
    return memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"] + memory["temp_bytes"]


def bytes_accessed(compiled) -> float | None:
    """XLA's ``cost_analysis()`` bytes read and written per device (a loop's body counted once)."""
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return None if not analysis or "bytes accessed" not in analysis else float(analysis["bytes accessed"])


# ----- a census of an optimized HLO module, each instruction weighted by how often a step runs it -----

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8,
                "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e\w+)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\s*\{\s*"n":\s*"(\d+)"')
_OPERANDS_END = re.compile(r"\)(?:, |$)")
GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
NATIVE_COLLECTIVES = COLLECTIVES + ("ragged-all-to-all",)
F8_TYPES = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3b11fnuz", "f8e8m0fnu")


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(text)]


def _bytes(arrays: list[tuple[str, tuple[int, ...]]]) -> float:
    return sum(_DTYPE_BYTES.get(dtype, 1) * math.prod(dims) for dtype, dims in arrays)


def _closing(text: str, depth: int) -> int:
    """The index of the parenthesis that closes ``depth`` open ones in ``text`` (its length if none)."""
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return index
    return len(text)


def _json_dims(config: str, key: str) -> list[int]:
    match = re.search(rf'"{key}":\s*\[([^\]]*)\]', config)
    return [int(d) for d in re.findall(r"\d+", match.group(1))] if match else []


@dataclasses.dataclass
class Instruction:
    """One HLO instruction: its name, result type text, opcode, operand names and attribute text."""

    name: str
    result: str
    opcode: str
    operands: list[str]
    attributes: str

    @classmethod
    def parse(cls, line: str) -> Instruction | None:
        match = _NAME.match(line)
        if match is None:
            return None
        rest = line[match.end():]
        if rest.startswith("("):  # a tuple type: up to its matching parenthesis
            end = _closing(rest, 0)
            result, rest = rest[:end + 1], rest[end + 2:]
        else:
            result, _, rest = rest.partition(" ")
        opcode, _, rest = rest.partition("(")
        end = _closing(rest, 1)
        operands = re.findall(r"%([\w.\-]+)", rest[:end])
        return cls(match.group(1), result, opcode, operands, rest[end + 1:])


@dataclasses.dataclass
class Census:
    """What one execution of a computation runs, its loops counted by their trip counts and a
    conditional by its costliest branch: matmul FLOPs (``dot``s, cuBLAS GEMMs, cuDNN attention from
    its shapes), custom calls by target, fusions by their backend kind (``__triton_gemm`` ...),
    collectives by op with their bytes (the larger of the operands and the results: the unsplit
    buffer), GEMMs with FP8 operands, and ``ragged-dot`` instructions left in the module."""

    flops: float = 0.0
    custom_calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fusion_kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    collectives: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    collective_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    async_collectives: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    async_collective_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fp8_gemms: float = 0.0
    ragged_dots: float = 0.0

    def add(self, other: Census, times: float = 1.0) -> None:
        self.flops += times * other.flops
        self.fp8_gemms += times * other.fp8_gemms
        self.ragged_dots += times * other.ragged_dots
        for mine, theirs in ((self.custom_calls, other.custom_calls), (self.fusion_kinds, other.fusion_kinds),
                             (self.collectives, other.collectives), (self.collective_bytes, other.collective_bytes),
                             (self.async_collectives, other.async_collectives),
                             (self.async_collective_bytes, other.async_collective_bytes)):
            for key, value in theirs.items():
                mine[key] += times * value

    def costliest(self, others: list[Census]) -> Census:
        """The branch of a conditional that does the most matmul FLOPs (ties: the most collectives)."""
        return max([self, *others], key=lambda c: (c.flops, sum(c.collectives.values())))


def _shapes_of(instructions: list[Instruction]) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    return {ins.name: _arrays(ins.result) for ins in instructions}


def _dot_flops(ins: Instruction, shapes: dict) -> float:
    lhs = shapes.get(ins.operands[0], [])
    out = _arrays(ins.result)
    if not lhs or not out:
        return 0.0
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attributes)
    dims = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
    return 2.0 * math.prod(out[0][1]) * math.prod(lhs[0][1][d] for d in dims)


def _gemm_flops(ins: Instruction, shapes: dict) -> float:
    lhs = shapes.get(ins.operands[0], [])
    out = _arrays(ins.result)
    if not lhs or not out:
        return 0.0
    return 2.0 * math.prod(out[0][1]) * math.prod(lhs[0][1][d] for d in _json_dims(ins.attributes,
                                                                                  "lhs_contracting_dimensions"))


def _left(dims: tuple[int, ...], known: tuple[int, ...]) -> int:
    """The one size of a 4-d operand left when each of ``known`` is taken out once."""
    rest = list(dims)
    for size in known:
        rest.remove(size)
    return rest[0]


def visible_fraction(queries: int, keys: int, causal: bool, window: int) -> float:
    """The fraction of query-key pairs a causal (or full) attention with a sliding ``window`` computes."""
    if not causal:
        return 1.0
    offset = keys - queries  # queries are the last ``queries`` positions
    seen = sum(min(offset + i + 1, window or keys) for i in range(queries))
    return seen / (queries * keys)


def cudnn_attention_flops(ins: Instruction) -> float:
    """A cuDNN fused attention call's matmul FLOPs from its shapes: the forward computes Q K^T and
    P V over the visible pairs; the backward recomputes Q K^T and computes dV, dP, dQ and dK (three
    products of the query width, two of the value width)."""
    config = ins.attributes
    scores = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]', config)
    start = ins.attributes.find("operand_layout_constraints={")
    if scores is None or start < 0:
        return 0.0
    batch, heads, queries, keys = (int(d) for d in re.findall(r"\d+", scores.group(1)))
    q, k, v = (dims for _, dims in _arrays(ins.attributes[start:ins.attributes.find("}}", start)])[:3])
    q_width = _left(q, (batch, queries, heads))
    kv_heads = _left(k, (batch, keys, q_width))
    v_width = _left(v, (batch, keys, kv_heads))
    causal = '"mask_type": "CAUSAL"' in config.replace('":"', '": "') or "PADDING_CAUSAL" in config
    window = re.search(r'"sliding_window_length":\s*"?(\d+)', config)
    window = int(window.group(1)) if window else 0
    pairs = batch * heads * queries * keys * visible_fraction(queries, keys, causal, window)
    backward = ins.attributes.split('custom_call_target="')[1].split('"')[0].endswith("Backward")
    return 2.0 * pairs * ((3 * q_width + 2 * v_width) if backward else (q_width + v_width))


def _branch_names(attributes: str) -> list[str]:
    """The computations a ``conditional`` instruction (its attribute text) chooses between."""
    branches = _BRANCHES.search(attributes)
    if branches:
        return [name.strip().lstrip("%") for name in branches.group(1).split(",")]
    called = dict(_CALLED.findall(attributes))
    return [called[key] for key in ("true_computation", "false_computation") if key in called]


class Module:
    """An optimized HLO module's text as computations, with a census per step (``census``)."""

    def __init__(self, text: str):
        self.computations: dict[str, list[Instruction]] = {}
        self.entry = None
        current: list[Instruction] | None = None
        for line in text.splitlines():
            header = _COMPUTATION.match(line)
            if header is not None:
                current = self.computations.setdefault(header.group(1), [])
                if line.startswith("ENTRY"):
                    self.entry = header.group(1)
            elif current is not None and (ins := Instruction.parse(line)) is not None:
                current.append(ins)
        self._censuses: dict[str, Census] = {}

    def loops(self) -> list[tuple[int, str]]:
        """Every while loop's (known trip count, or 1, and body computation), in the module's order."""
        found = []
        for instructions in self.computations.values():
            for ins in instructions:
                if ins.opcode == "while":
                    trips = _TRIP_COUNT.search(ins.attributes)
                    found.append((int(trips.group(1)) if trips else 1, dict(_CALLED.findall(ins.attributes))["body"]))
        return found

    def census(self, computation: str | None = None) -> Census:
        """One execution of ``computation`` (default: the entry, i.e. one step)."""
        name = computation or self.entry
        if name in self._censuses:
            return self._censuses[name]
        total = Census()
        instructions = self.computations.get(name, [])
        shapes = _shapes_of(instructions)
        for ins in instructions:
            total.add(self._own(ins, shapes))
            if ins.opcode.endswith(("-done", "-update")):
                continue  # an async op's halves name the same computation as its start
            called = dict(_CALLED.findall(ins.attributes))
            if ins.opcode == "while":
                trips = _TRIP_COUNT.search(ins.attributes)
                total.add(self.census(called["body"]), float(trips.group(1)) if trips else 1.0)
            elif ins.opcode == "conditional":
                censuses = [self.census(n) for n in _branch_names(ins.attributes)]
                if censuses:
                    total.add(censuses[0].costliest(censuses[1:]))
            else:
                for key in ("calls", "to_apply"):
                    if key in called and not (key == "to_apply" and ins.opcode != "call"):
                        total.add(self.census(called[key]))
        self._censuses[name] = total
        return total

    @staticmethod
    def _own(ins: Instruction, shapes: dict) -> Census:
        own = Census()
        opcode = ins.opcode.removesuffix("-start")
        operands = [array for name in ins.operands for array in shapes.get(name, [])]
        if ins.opcode == "dot":
            own.flops = _dot_flops(ins, shapes)
            own.fp8_gemms = float(any(dtype in F8_TYPES for dtype, _ in operands[:2]))
        elif ins.opcode == "ragged-dot":
            own.ragged_dots = 1.0
        elif ins.opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', ins.attributes)
            target = target.group(1) if target else "?"
            own.custom_calls[target] += 1
            if target in GEMM_CALLS:
                own.flops = _gemm_flops(ins, shapes)
                own.fp8_gemms = float(target.endswith("f8") or any(dtype in F8_TYPES for dtype, _ in operands[:2]))
            elif target.startswith("__cudnn$fmha"):
                own.flops = cudnn_attention_flops(ins)
        elif ins.opcode in ("fusion", "fusion-start"):
            kind = re.search(r'"kind":\s*"(__[\w]+)"', ins.attributes)
            if kind:
                own.fusion_kinds[kind.group(1)] += 1
        if opcode in NATIVE_COLLECTIVES and not ins.opcode.endswith(("-done", "-update")):
            results = _arrays(ins.result)
            result_bytes = _bytes(results)
            operand_bytes = _bytes(operands)
            if ins.opcode.endswith("-start") and ins.result.startswith("(("):
                result_bytes -= operand_bytes  # ((operands), results)
            own.collectives[opcode] += 1
            own.collective_bytes[opcode] += max(result_bytes, operand_bytes)
            if ins.opcode.endswith("-start"):
                own.async_collectives[opcode] += 1
                own.async_collective_bytes[opcode] += max(result_bytes, operand_bytes)
        return own


# ----- what the census leaves out of a GPU module: Pallas kernels and kernel launches -----

# Custom-call targets of Pallas kernels: Mosaic GPU, Triton (jax-triton's FFI call, Pallas Triton).
PALLAS_CALLS = ("mosaic_gpu", "triton_kernel_call", "__gpu$xla.gpu.triton")
# Instructions that launch no kernel.
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "opt-barrier", "copy-done", "async-done", "async-update"}


def _grouped_flops(result: tuple[int, ...], operands: list[tuple[int, ...]]) -> float:
    """A grouped GEMM's FLOPs from its shapes: out [m, n] from lhs [m, k] is ``2 m k n``; a weight
    gradient out [g, k, n] from rows [m, n] (or [n, m]) is ``2 m k n`` (each row in one group)."""
    flat = [s for s in operands if len(s) == 2]
    if len(result) == 2:
        lhs = next((s for s in flat if s[0] == result[0]), None)
        return 2.0 * math.prod(result) * lhs[1] if lhs else 0.0
    if len(result) == 3:
        rows = next((s for s in flat if result[2] in s), None)
        if rows:
            m = rows[0] if rows[1] == result[2] else rows[1]
            return 2.0 * m * result[1] * result[2]
    return 0.0


def pallas_calls(hlo: str) -> list[tuple[str, float]]:
    """(target, FLOPs from shapes) of every Pallas custom call in ``hlo``, once per appearance: a
    flash attention's (``_attention_flops``) or a grouped GEMM's (``_grouped_flops``)."""
    found, shapes = [], {}
    for line in hlo.splitlines():
        named = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\([^=]*?\)|\S+) ", line)
        if named:
            shapes[named.group(1)] = [dims for _, dims in _arrays(named.group(2))]
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if "custom-call(" not in line or not target or not target.group(1).startswith(PALLAS_CALLS):
            continue
        result = _arrays(line.split(" = ", 1)[1].split(" custom-call(")[0])
        layouts = re.search(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}", line)
        names = re.findall(r"%([\w.\-]+)", line.split(" custom-call(", 1)[1].split(")")[0])
        operands = ([dims for _, dims in _arrays(layouts.group(1))] if layouts else
                    [dims for name in names for dims in shapes.get(name, [])])
        flops = _attention_flops([dims for _, dims in result], operands)
        if flops is None:
            flops = _grouped_flops(result[0][1], operands) if len(result) == 1 else 0.0
        found.append((target.group(1), flops))
    return found


def _attention_flops(result: list[tuple[int, ...]], operands: list[tuple[int, ...]]) -> float | None:
    """A flash-attention call's matmul FLOPs from its shapes, None where its first operands are not
    q [..., T, H, D], k [..., S, h, D], v [..., S, h, d] (H a multiple of h). Counted over the causal
    pairs (every call ``models.kernels.attention.tokamax_attention`` makes; the kernels skip the key
    blocks past the diagonal, those before a query's first visible key only at run time: an upper
    bound with documents or a window). A call given an array shaped like the output ([..., T, H,
    d]: the output or its cotangent) is a backward one, counted by the gradients it returns: dQ
    alone (one result) recomputes Q K^T and dP and computes dQ (two products of the query width, one
    of the value width); dK and dV (two results) recompute Q K^T and dP and compute dK and dV (two
    of each); all three (Pallas Triton's one kernel) both. Else a forward: Q K^T and P V."""
    if len(operands) < 3:
        return None
    q, k, v = operands[:3]
    if not (len(q) >= 3 and len(k) == len(v) == len(q) and q[-1] == k[-1] and k[:-1] == v[:-1]
            and q[:-3] == k[:-3] and q[-2] % k[-2] == 0):
        return None
    *batch, queries, heads, q_width = q
    keys, v_width = k[-3], v[-1]
    pairs = math.prod(batch) * heads * queries * keys * visible_fraction(queries, keys, True, 0)
    if (*q[:-1], v_width) not in operands[3:]:
        return 2.0 * pairs * (q_width + v_width)
    d_queries, d_keys_values = 2 * q_width + v_width, 2 * q_width + 2 * v_width
    return 2.0 * pairs * {1: d_queries, 2: d_keys_values}.get(len(result), d_queries + d_keys_values)


def kernels_launched(module: Module, name: str | None = None) -> float:
    """Kernel-launching instructions of one execution of ``name`` (the entry by default), a loop's
    body by its known trip count, a conditional as one launch plus its costliest branch."""
    total = 0.0
    for ins in module.computations.get(name or module.entry, []):
        called = dict(_CALLED.findall(ins.attributes))
        if ins.opcode == "while":
            trips = _TRIP_COUNT.search(ins.attributes)
            total += (int(trips.group(1)) if trips else 1) * kernels_launched(module, called["body"])
        elif ins.opcode == "conditional":
            total += 1 + max((kernels_launched(module, n) for n in _branch_names(ins.attributes)), default=0)
        elif ins.opcode == "call":
            total += kernels_launched(module, called.get("to_apply"))
        elif ins.opcode not in _FREE:
            total += 1
    return total
