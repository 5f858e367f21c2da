"""What a benchmark run measured, as vLLM's `bench serve` reports it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    input_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # seconds between streamed token chunks
    counted_by: str = ""  # how input_len / output_len were counted (stagemesh.entry.bench.counting); "" not yet
    text: str = ""  # the completion's text, for counting its tokens when the stream brought no usage
    stream_token_ids: int = 0  # token ids the stream carried (return_token_ids)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(xs) - 1)
    return xs[low] + (xs[high] - xs[low]) * (pos - low)


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    out = {f"mean_{name}_ms": sum(ms) / len(ms) if ms else 0.0}
    for q in (50, 90, 99):
        out[f"p{q}_{name}_ms"] = percentile(ms, q)
    return out


def summarize(results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.ok]
    output = sum(r.output_len for r in done)
    total_input = sum(r.input_len for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1]
    summary: dict[str, Any] = {
        "successful_requests": len(done), "failed_requests": len(results) - len(done),
        "duration_s": duration, "total_input_tokens": total_input, "total_output_tokens": output,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (output + total_input) / duration if duration else 0.0,
    }
    # how the token counts were made (stagemesh.entry.bench.counting): the server's usage, or the text counted again
    summary["tokens_counted_by"] = sorted({r.counted_by for r in done if r.counted_by})
    summary.update(_stats("ttft", [r.ttft for r in done]))
    summary.update(_stats("tpot", tpot))
    summary.update(_stats("itl", [x for r in done for x in r.itl]))
    # per request, in workload order (vLLM's saved results carry the same lists)
    summary["input_lens"] = [r.input_len for r in results]
    summary["output_lens"] = [r.output_len for r in results]
    summary["ttfts_ms"] = [round(r.ttft * 1000, 3) for r in results]
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:10]
    return summary


def table(summary: dict, title: str = "Serving Benchmark Result") -> str:
    rows = [("Successful requests:", summary["successful_requests"]),
            ("Failed requests:", summary["failed_requests"]),
            ("Benchmark duration (s):", f"{summary['duration_s']:.2f}"),
            ("Total input tokens:", summary["total_input_tokens"]),
            ("Total generated tokens:", summary["total_output_tokens"]),
            ("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}")]
    lines = [f"{' ' + title + ' ':=^60}"] + [f"{k:<44}{v:>16}" for k, v in rows]
    for way in summary.get("tokens_counted_by", []):
        lines.append(f"Tokens counted by: {way}")
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency")):
        lines.append(f"{label:-^60}")
        lines.append(f"{'Mean ' + name.upper() + ' (ms):':<44}{summary[f'mean_{name}_ms']:>16.2f}")
        for q in (50, 90, 99):
            lines.append(f"{f'P{q} ' + name.upper() + ' (ms):':<44}{summary[f'p{q}_{name}_ms']:>16.2f}")
    if "baseline" in summary:
        b = summary["baseline"]
        lines.append(f"{'Baseline':-^60}")
        lines.append(b["name"])
        lines.append(f"{'Output token throughput (tok/s):':<44}{b['output_throughput']:>16.2f}")
        lines.append(f"{'Ratio (serving / baseline):':<44}{summary['ratio_to_baseline']:>16.2f}")
    lines.append("=" * 60)
    for err in summary.get("errors", []):
        lines.append(f"error: {err}")
    return "\n".join(lines)
