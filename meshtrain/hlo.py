"""What scripts and tests read out of a compiled XLA program: its collectives (from the optimized HLO
text) and XLA's own per-device memory and cost figures."""

from __future__ import annotations

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
