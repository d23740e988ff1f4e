#!/usr/bin/env python
"""Where the H200's time goes: group a vLLM torch-profiler trace of the daemon by part of the page,
and measure the GPU's own ceilings.

  python bench/profile_gpu.py summarise TRACE_DIR_OR_FILE [--record R.json] --out S.json
      [--prompt-tokens 5017] [--output-tokens 1500]
  python bench/profile_gpu.py regroup S.json --out S2.json   (the rules again, no trace needed when
                                                         its top kernels hold all the kernel time)
  python bench/profile_gpu.py ceilings --out C.json      (on the GPU: GEMM TFLOP/s, copy GB/s,
                                                         the vision encoder's attention per backend)

The trace is the worker's (EngineCore) chrome trace that vLLM's profiler writes
(``profiler_config.torch_profiler_dir``; bench/profiled_daemon.py starts and stops it inside the
running daemon). Every GPU kernel (and memcpy/memset) is tied through its correlation id to the CPU
launch (``cudaLaunchKernel``, ``cudaGraphLaunch``: a CUDA graph's kernels carry its launch's id)
and so to what the engine thread was doing then:

* the step: vLLM's worker marks each ``execute_model`` ``execute_context_N(T)_generation_M(U)``
  (N requests prefilling T prompt tokens, M decoding U tokens); a step is "mixed" when T > 0,
  else "decode";
* the model runner's scope (VLLM_CUSTOM_SCOPES_FOR_PROFILING=1): ``forward`` (the language
  model), ``postprocess`` (the logits: the LM head), ``sample``; whatever a step launches outside
  these is the pre-forward part, where the vision encoder runs (``_preprocess`` ->
  ``_execute_mm_encoder``, then the embeddings are gathered).

Groups (name patterns in GROUP_RULES, applied within a scope): vision encoder attention / GEMMs
(qkv, proj, MLP, patch embed, merger) / other; language-model GEMMs (forward) and the LM head
(postprocess); gated-delta-net prefill (chunked kernels, causal conv fwd) and decode (recurrent
update, conv update); full attention (FlashAttention/Triton attention, KV-cache writes), split by
step type (mixed steps hold the prefills; decode-only steps hold decode only); sampling; other.
Idle: the window (first kernel start to last kernel end) minus the union of kernel intervals,
split into gaps between steps and gaps inside steps.

The summary keeps the top kernels by time with their scope, step type and group, so a regrouping
needs no new trace.
"""

from __future__ import annotations

import argparse
import bisect
import glob
import gzip
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

STEP_RE = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
SCOPE_PREFIX = "gpu_model_runner: "

GEMM = r"nvjet|gemm|gemv|xmma|cublas|matmul|wgmma|triton_tem|splitkreduce|cutlass(?!.*flash)|_mm_|\bmm\b|conv"
ATTN = r"flash|fmha|attn|attention|sdpa|reshape_and_cache|concat_and_cache"
GDN_PREFILL = r"chunk|solve_tril|merge_16x16|recompute_w_u|kkt|cumsum|causal_conv1d_fwd|post_conv|l2norm"
GDN_DECODE = r"fused_recurrent|packed_decode|causal_conv1d_update|sigmoid_gating_delta_rule"
GDN_EITHER = r"gdn_gating|gated_delta"

# (scope, pattern, group); first match wins. Scope "pre" = launched inside a step, outside
# forward/postprocess/sample (the vision encoder and embedding gather run there).
INPUT_PREP = r"memcpy|memset|batch_memcpy|slot_mapping|zero_kv_blocks|prepare_varlen"

GROUP_RULES: list[tuple[str, str, str]] = [
    ("pre", INPUT_PREP, "input_prep"),
    ("pre", ATTN, "vision_attention"),
    ("pre", GEMM, "vision_gemm"),
    ("pre", r".", "vision_other"),
    ("forward", GDN_DECODE, "gdn_decode"),
    ("forward", GDN_PREFILL, "gdn_prefill"),
    ("forward", GDN_EITHER, "gdn_{step}"),
    ("forward", ATTN, "full_attention_{step}"),
    ("forward", GEMM, "lm_gemm"),
    ("forward", r".", "lm_other"),
    ("postprocess", GEMM, "lm_head_gemm"),
    ("postprocess", r".", "sampling"),
    ("sample", r".", "sampling"),
    ("none", r".", "outside_steps"),
]
_RULES = [(scope, re.compile(pattern, re.I), group) for scope, pattern, group in GROUP_RULES]

# Groups as the issue names them (vision encoder "MLP" = all its GEMMs: qkv, proj, MLP, patch embed, merger).
REPORT_GROUPS = [
    ("vision encoder attention", ["vision_attention"]),
    ("vision encoder GEMMs (qkv, proj, MLP)", ["vision_gemm"]),
    ("vision encoder other (norms, GELU, rotary, embeddings)", ["vision_other"]),
    ("LM GEMMs (forward)", ["lm_gemm"]),
    ("LM head GEMM (logits)", ["lm_head_gemm"]),
    ("gated-delta-net prefill", ["gdn_prefill", "gdn_mixed"]),
    ("gated-delta-net decode", ["gdn_decode", "gdn_decode_step"]),
    ("full attention, mixed steps (prefill + the decodes riding along)", ["full_attention_mixed"]),
    ("full attention, decode-only steps", ["full_attention_decode"]),
    ("sampling", ["sampling"]),
    ("input preparation (copies of the batch's metadata, slot mapping; GDN state copies)", ["input_prep"]),
    ("other LM (norms, activations, rotary, gating; fused Triton)", ["lm_other"]),
    ("outside steps", ["outside_steps"]),
]


def classify(scope: str, name: str, step_type: str) -> str:
    if scope == "pre" and step_type == "decode":
        return "input_prep"  # no image is encoded in a step without prompt tokens
    for rule_scope, pattern, group in _RULES:
        if rule_scope == scope and pattern.search(name):
            return group.format(step=step_type if step_type else "decode")
    return "unclassified"


def load_trace(path: str) -> dict[str, Any]:
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*.pt.trace.json*"), recursive=True),
                       key=os.path.getsize)
        if not files:
            raise SystemExit(f"no *.pt.trace.json[.gz] under {path}")
        path = files[-1]  # the worker's (the front end's, if any, is far smaller)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        trace = json.load(handle)
    trace["_path"] = path
    trace["_bytes"] = os.path.getsize(path)
    return trace


class Intervals:
    """Sorted, possibly nested CPU ranges of one kind; innermost containing range of a time point."""

    def __init__(self, ranges: list[tuple[float, float, Any]]) -> None:
        self.ranges = sorted(ranges, key=lambda r: r[0])
        self.starts = [r[0] for r in self.ranges]

    def find(self, t: float) -> Any:
        i = bisect.bisect_right(self.starts, t) - 1
        best = None
        # ranges of one kind do not nest here (one step at a time); look back a few for safety
        for j in range(i, max(-1, i - 4), -1):
            s, e, payload = self.ranges[j]
            if s <= t <= e:
                best = payload
                break
        return best

    def last_before(self, t: float) -> Any:
        i = bisect.bisect_right(self.starts, t) - 1
        return self.ranges[i][2] if i >= 0 else None


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def summarise(trace: dict[str, Any], prompt_tokens: int, output_tokens: int, top: int = 120) -> dict[str, Any]:
    events = trace.get("traceEvents", [])
    gpu_cats = {"kernel", "gpu_memcpy", "gpu_memset"}
    kernels, launches = [], {}
    steps_raw, scopes_raw = [], defaultdict(list)
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat", "")
        if cat in gpu_cats:
            kernels.append(ev)
        elif cat in ("cuda_runtime", "cuda_driver"):
            corr = (ev.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = ev
        elif cat == "user_annotation":
            name = ev.get("name", "")
            m = STEP_RE.search(name)
            if m:
                steps_raw.append((ev["ts"], ev["ts"] + ev.get("dur", 0), {
                    "ts": ev["ts"], "end": ev["ts"] + ev.get("dur", 0),
                    "ctx_reqs": int(m.group(1)), "ctx_tokens": int(m.group(2)),
                    "gen_reqs": int(m.group(3)), "gen_tokens": int(m.group(4))}))
            elif name.startswith(SCOPE_PREFIX):
                scope = name[len(SCOPE_PREFIX):]
                scopes_raw[scope].append((ev["ts"], ev["ts"] + ev.get("dur", 0), scope))
    steps = Intervals(steps_raw)
    for i, (_, _, st) in enumerate(steps.ranges):
        st["index"] = i
        st["type"] = "mixed" if st["ctx_tokens"] > 0 else "decode"
        st["kernel_us"] = 0.0
        st["first"] = None
        st["last"] = None
        st["intervals"] = []
    scope_index = {scope: Intervals(r) for scope, r in scopes_raw.items()}

    by_group: dict[str, float] = defaultdict(float)
    by_group_count: dict[str, int] = defaultdict(int)
    by_kernel: dict[tuple[str, str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    all_intervals = []
    unmatched = 0
    for k in kernels:
        ts, dur = float(k["ts"]), float(k.get("dur", 0))
        corr = (k.get("args") or {}).get("correlation")
        launch = launches.get(corr)
        step, scope = None, "none"
        if launch is not None:
            t = float(launch["ts"])
            step = steps.find(t)
            for name in ("forward", "postprocess", "sample"):
                idx = scope_index.get(name)
                if idx is not None and idx.find(t) is not None:
                    scope = name
                    break
            if scope == "sample" and step is None:
                step = steps.last_before(t)  # sample_tokens runs after its execute_model
            if scope == "none" and step is not None:
                scope = "pre"
        else:
            unmatched += 1
        step_type = step["type"] if step else ""
        name = k.get("name", "?")
        group = classify(scope, name, step_type)
        by_group[group] += dur
        by_group_count[group] += 1
        key = (name[:200], scope, step_type, group)
        by_kernel[key][0] += dur
        by_kernel[key][1] += 1
        all_intervals.append((ts, ts + dur))
        if step is not None:
            step["kernel_us"] += dur
            step["intervals"].append((ts, ts + dur))
            step["first"] = ts if step["first"] is None else min(step["first"], ts)
            step["last"] = ts + dur if step["last"] is None else max(step["last"], ts + dur)
            step.setdefault("groups", defaultdict(float))[group] += dur

    if not all_intervals:
        return {"error": "no GPU kernels in the trace", "events": len(events)}
    w0 = min(s for s, _ in all_intervals)
    w1 = max(e for _, e in all_intervals)
    window = w1 - w0
    busy = union_length(all_intervals)

    # Steps with kernels, in GPU order: gaps between them, and idle inside each.
    gpu_steps = sorted((st for _, _, st in steps.ranges if st["first"] is not None), key=lambda s: s["first"])
    between, inside = 0.0, 0.0
    gaps_between = []
    for a, b in zip(gpu_steps, gpu_steps[1:]):
        gap = max(0.0, b["first"] - a["last"])
        gaps_between.append(gap)
        between += gap
    per_type: dict[str, dict[str, Any]] = {}
    for st in gpu_steps:
        span = st["last"] - st["first"]
        st_busy = union_length(st["intervals"])
        inside += max(0.0, span - st_busy)
        t = per_type.setdefault(st["type"], {"steps": 0, "span_us": [], "busy_us": [], "ctx_tokens": 0,
                                             "gen_tokens": 0, "ctx_reqs": 0, "gen_reqs": [], "groups_us": defaultdict(float)})
        t["steps"] += 1
        t["span_us"].append(span)
        t["busy_us"].append(st_busy)
        t["ctx_tokens"] += st["ctx_tokens"]
        t["ctx_reqs"] += st["ctx_reqs"]
        t["gen_tokens"] += st["gen_tokens"]
        t["gen_reqs"].append(st["gen_reqs"])
        for g, us in st.get("groups", {}).items():
            t["groups_us"][g] += us
    step_types = {}
    for name, t in per_type.items():
        step_types[name] = {
            "steps": t["steps"], "ctx_tokens": t["ctx_tokens"], "ctx_reqs": t["ctx_reqs"],
            "gen_tokens": t["gen_tokens"],
            "gen_reqs_median": statistics.median(t["gen_reqs"]) if t["gen_reqs"] else 0,
            "span_ms_median": round(statistics.median(t["span_us"]) / 1e3, 3),
            "span_ms_total": round(sum(t["span_us"]) / 1e3, 1),
            "busy_ms_median": round(statistics.median(t["busy_us"]) / 1e3, 3),
            "busy_ms_total": round(sum(t["busy_us"]) / 1e3, 1),
            "groups_ms": {g: round(us / 1e3, 2) for g, us in sorted(t["groups_us"].items(), key=lambda kv: -kv[1])},
        }

    total_kernel = sum(by_group.values())
    groups = {g: {"ms": round(us / 1e3, 2), "frac_of_kernel_time": round(us / total_kernel, 4),
                  "frac_of_window": round(us / window, 4), "kernels": by_group_count[g]}
              for g, us in sorted(by_group.items(), key=lambda kv: -kv[1])}
    report = []
    for label, keys in REPORT_GROUPS:
        us = sum(by_group.get(k, 0.0) for k in keys)
        report.append({"group": label, "keys": keys, "ms": round(us / 1e3, 2),
                       "pct_of_window": round(100 * us / window, 2)})
    idle = window - busy
    report.append({"group": "idle: between steps", "ms": round(between / 1e3, 2),
                   "pct_of_window": round(100 * between / window, 2)})
    report.append({"group": "idle: inside steps", "ms": round(inside / 1e3, 2),
                   "pct_of_window": round(100 * inside / window, 2)})
    report.append({"group": "idle: other (before the first / after the last step, overlap rounding)",
                   "ms": round((idle - between - inside) / 1e3, 2),
                   "pct_of_window": round(100 * (idle - between - inside) / window, 2)})

    ctx = sum(t["ctx_tokens"] for t in per_type.values())
    gen = sum(t["gen_tokens"] for t in per_type.values())
    top_kernels = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    out = {
        "trace_file": trace.get("_path"), "trace_bytes": trace.get("_bytes"), "events": len(events),
        "kernels": len(kernels), "kernels_without_launch": unmatched,
        "window_ms": round(window / 1e3, 2), "gpu_busy_ms": round(busy / 1e3, 2),
        "gpu_busy_frac": round(busy / window, 4), "kernel_time_ms": round(total_kernel / 1e3, 2),
        "idle_ms": round(idle / 1e3, 2), "idle_between_steps_ms": round(between / 1e3, 2),
        "idle_inside_steps_ms": round(inside / 1e3, 2),
        "gap_between_steps_us_median": round(statistics.median(gaps_between), 1) if gaps_between else None,
        "gap_between_steps_us_p90": round(sorted(gaps_between)[int(0.9 * (len(gaps_between) - 1))], 1) if gaps_between else None,
        "steps": len(gpu_steps), "step_types": step_types,
        "prompt_tokens_in_window": ctx, "decoded_tokens_in_window": gen,
        "pages_prefilled_in_window": round(ctx / prompt_tokens, 2) if prompt_tokens else None,
        "pages_decoded_in_window": round(gen / output_tokens, 2) if output_tokens else None,
        "prompt_tokens_per_page": prompt_tokens, "output_tokens_per_page": output_tokens,
        "report": report, "groups": groups,
        "top_kernels": [{"name": k[0], "scope": k[1], "step": k[2], "group": k[3], "ms": round(v[0] / 1e3, 3),
                         "count": v[1]} for k, v in top_kernels],
        "rules": GROUP_RULES,
    }
    return out


def regroup(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with groups, report and per-step-type group times recomputed from top_kernels
    under the current GROUP_RULES (only where top_kernels hold all the kernel time)."""
    covered = sum(k["ms"] for k in summary["top_kernels"])
    if abs(covered - summary["kernel_time_ms"]) > 0.01 * summary["kernel_time_ms"]:
        raise SystemExit(f"top_kernels hold {covered:.1f} of {summary['kernel_time_ms']} ms: summarise the trace again")
    window = summary["window_ms"]
    by_group: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    per_type: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for k in summary["top_kernels"]:
        k["group"] = classify(k["scope"], k["name"], k["step"])
        by_group[k["group"]] += k["ms"]
        counts[k["group"]] += k["count"]
        if k["step"]:
            per_type[k["step"]][k["group"]] += k["ms"]
    total = sum(by_group.values())
    summary["groups"] = {g: {"ms": round(ms, 2), "frac_of_kernel_time": round(ms / total, 4),
                             "frac_of_window": round(ms / window, 4), "kernels": counts[g]}
                         for g, ms in sorted(by_group.items(), key=lambda kv: -kv[1])}
    for name, groups in per_type.items():
        if name in summary["step_types"]:
            summary["step_types"][name]["groups_ms"] = {g: round(ms, 2) for g, ms in
                                                        sorted(groups.items(), key=lambda kv: -kv[1])}
    idle_rows = [row for row in summary["report"] if row["group"].startswith("idle")]
    report = []
    for label, keys in REPORT_GROUPS:
        ms = sum(by_group.get(k, 0.0) for k in keys)
        report.append({"group": label, "keys": keys, "ms": round(ms, 2), "pct_of_window": round(100 * ms / window, 2)})
    summary["report"] = report + idle_rows
    summary["rules"] = GROUP_RULES
    summary["regrouped"] = True
    return summary


def table(summary: dict[str, Any]) -> str:
    lines = [f"window {summary['window_ms']} ms, GPU busy {100 * summary['gpu_busy_frac']:.1f} %, "
             f"{summary['steps']} steps, {summary['kernels']} kernels "
             f"({summary['kernels_without_launch']} without a launch), prompt tokens {summary['prompt_tokens_in_window']} "
             f"({summary['pages_prefilled_in_window']} pages), decoded {summary['decoded_tokens_in_window']} "
             f"({summary['pages_decoded_in_window']} pages)"]
    for row in summary["report"]:
        lines.append(f"  {row['group'][:70]:70s} {row['ms']:10.1f} ms {row['pct_of_window']:6.2f} %")
    for name, t in summary["step_types"].items():
        lines.append(f"  steps {name}: {t['steps']} (span median {t['span_ms_median']} ms, ctx tokens {t['ctx_tokens']}, "
                     f"gen tokens {t['gen_tokens']}, gen reqs median {t['gen_reqs_median']})")
    for k in summary["top_kernels"][:25]:
        lines.append(f"  {k['ms']:9.1f} ms {k['count']:6d}x {k['group']:22s} {k['step']:6s} {k['name'][:90]}")
    return "\n".join(lines)


# -- ceilings (on the GPU) ----------------------------------------------------------------------


def ceilings(out_path: str) -> dict[str, Any]:
    import torch

    res: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    dev = "cuda"

    def bench(fn, reps: int = 20, warm: int = 3) -> float:
        """median seconds of fn() over reps, CUDA events."""
        for _ in range(warm):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        return statistics.median(times)

    def guarded(name: str, fn) -> None:
        t = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as error:  # one failing probe must not cost the others
            res[name] = {"error": repr(error)[:500]}
        print(f"[ceilings] {name}: {res[name]} ({time.perf_counter() - t:.1f} s)", flush=True)

    def gemm_bf16() -> dict[str, Any]:
        n = 8192
        xs = [torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        ys = [torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        i = [0]

        def f():
            i[0] = (i[0] + 1) % 3
            return xs[i[0]] @ ys[i[0]]
        s = bench(f)
        return {"shape": [n, n, n], "tflops": round(2 * n ** 3 / s / 1e12, 1), "ms": round(s * 1e3, 3)}

    def gemm_shapes() -> dict[str, Any]:
        """The stand-in's own GEMMs: prefill (16 384 tokens) and decode (192 tokens) shapes."""
        out = {}
        for label, m in (("prefill_16384", 16384), ("decode_192", 192)):
            for k, n, what in ((2560, 12288, "gdn_in_proj"), (2560, 18432, "mlp_gate_up"), (9216, 2560, "mlp_down"),
                               (2560, 248320, "lm_head")):
                if what == "lm_head" and m != 192:
                    continue
                a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                s = bench(lambda: torch.nn.functional.linear(a, w))
                flops = 2 * m * k * n
                byts = 2 * (m * k + k * n + m * n)
                out[f"{label}:{what}"] = {"m": m, "k": k, "n": n, "tflops": round(flops / s / 1e12, 1),
                                          "gbps": round(byts / s / 1e9, 0), "us": round(s * 1e6, 1)}
                del a, w
        return out

    def copy_bw() -> dict[str, Any]:
        n = 2 * 1024 ** 3  # bytes per buffer
        bufs = [torch.empty(n // 2, device=dev, dtype=torch.bfloat16).normal_() for _ in range(2)]
        dst = torch.empty_like(bufs[0])
        i = [0]

        def f():
            i[0] ^= 1
            dst.copy_(bufs[i[0]])
        s = bench(f)
        return {"bytes_moved": 2 * n, "gbps_read_plus_write": round(2 * n / s / 1e9, 0), "ms": round(s * 1e3, 3)}

    def vision_attention() -> dict[str, Any]:
        """One page's vision encoder attention layer (Letter at 192 dpi: ~13 744 patches, 16 heads of 64),
        non-causal, through each backend vLLM 0.26 offers for it on this machine."""
        n, h, d = 13744, 16, 64
        q, k, v = (torch.randn(n, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0, n], device=dev, dtype=torch.int32)
        flops = 4 * n * n * h * d
        out: dict[str, Any] = {"patches": n, "heads": h, "head_dim": d, "gflop_per_layer": round(flops / 1e9, 1)}

        def record(name: str, fn) -> None:
            try:
                s = bench(fn, reps=10)
                out[name] = {"ms": round(s * 1e3, 3), "tflops": round(flops / s / 1e12, 1)}
            except Exception as error:
                out[name] = {"error": repr(error)[:300]}
        try:
            from vllm.vllm_flash_attn import flash_attn_varlen_func
            for ver in (3, 2):
                record(f"FLASH_ATTN_fa{ver}", lambda ver=ver: flash_attn_varlen_func(
                    q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n, causal=False,
                    softmax_scale=d ** -0.5, fa_version=ver))
        except Exception as error:
            out["FLASH_ATTN"] = {"error": repr(error)[:300]}
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
            def f(backend=backend):
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb)
            record(f"TORCH_SDPA_{backend}", f)
        try:
            from vllm.v1.attention.ops.triton_prefill_attention import context_attention_fwd
            o = torch.empty_like(q)
            lens = torch.tensor([n], device=dev, dtype=torch.int32)
            record("TRITON_ATTN", lambda: context_attention_fwd(q, k, v, o, b_start_loc=cu[:-1], b_seq_len=lens,
                                                                 max_input_len=n, is_causal=False,
                                                                 softmax_scale=d ** -0.5))
        except Exception as error:
            out["TRITON_ATTN"] = {"error": repr(error)[:300]}
        return out

    guarded("gemm_bf16_8192", gemm_bf16)
    guarded("copy", copy_bw)
    guarded("gemm_shapes", gemm_shapes)
    guarded("vision_attention", vision_attention)
    torch.cuda.empty_cache()
    with open(out_path, "w") as handle:
        json.dump(res, handle, indent=2)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarise")
    s.add_argument("trace")
    s.add_argument("--record", help="bench/profiled_daemon.py's record (times of start/stop)")
    s.add_argument("--out", required=True)
    s.add_argument("--prompt-tokens", type=int, default=5017)
    s.add_argument("--output-tokens", type=int, default=1500)
    r = sub.add_parser("regroup", help="re-apply GROUP_RULES to a summary whose top_kernels hold all its kernel time")
    r.add_argument("summary")
    r.add_argument("--out", required=True)
    c = sub.add_parser("ceilings")
    c.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "ceilings":
        ceilings(a.out)
        return 0
    if a.cmd == "regroup":
        with open(a.summary) as handle:
            summary = json.load(handle)
        regrouped = regroup(summary)
        with open(a.out, "w") as handle:
            json.dump(regrouped, handle, indent=1)
        print(table(regrouped))
        return 0
    t = time.perf_counter()
    trace = load_trace(a.trace)
    loaded = time.perf_counter() - t
    summary = summarise(trace, a.prompt_tokens, a.output_tokens)
    summary["load_s"] = round(loaded, 1)
    summary["summarise_s"] = round(time.perf_counter() - t - loaded, 1)
    if a.record and os.path.exists(a.record):
        with open(a.record) as handle:
            summary["record"] = json.load(handle)
    with open(a.out, "w") as handle:
        json.dump(summary, handle, indent=1)
    if "error" not in summary:
        print(table(summary))
    else:
        print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
