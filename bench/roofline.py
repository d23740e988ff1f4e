#!/usr/bin/env python
"""A roofline per part of a page for the chandra2-like stand-in, against the H200's measured ceilings
and the grouped kernel profiles (bench/profile_gpu.py): FLOPs and bytes per page from the model's
shapes, the floor each part cannot beat (max of FLOPs / GEMM rate and bytes / copy bandwidth; the
vision attention also against FlashAttention 3's own rate at one page's shape), what the profile
measured, and how far from its floor each part runs. Runs anywhere (no GPU).

  python bench/roofline.py --ceilings C.json --prefill P.json --decode D.json [--out R.json]

The shapes are make_model.py's chandra2-like (../shared/device/make_model.py; copied below so this
runs without it). Per-page conventions: a US-Letter page at 192 dpi is 1632 x 2112 px = 102 x 132
patches of 16 px (13 464) merged 2 x 2 into 3 366 image tokens; the prompt is 5 017 tokens
(chandrad's own prompt in the stand-in's tokenizer); 1 500 decoded tokens at a batch of 192
sequences, i.e. 1 500 / 192 = 7.81 decode steps' worth per page. Prefill parts are measured per page
prefilled in the prefill-heavy window (prompt tokens / 5 017); decode parts per decode step in the
decode-only window, times 7.81, the full attention scaled from the window's context to the page's
mean context (prompt + half the output). Estimates (elementwise bytes, GDN chunk bytes) say so.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

TEXT = dict(hidden=2560, inter=9216, layers=32, full_every=4, heads=16, kv_heads=4, head_dim=256,
            lin_k_heads=16, lin_v_heads=32, lin_k_dim=128, lin_v_dim=128, vocab=248320, conv=4)
VISION = dict(depth=24, hidden=1024, inter=4096, heads=16, patch=16, temporal=2, merge=2)
BF16, FP32 = 2, 4


def shapes() -> dict[str, float]:
    t, v = TEXT, VISION
    full = t["layers"] // t["full_every"]
    gdn = t["layers"] - full
    q_dim = t["heads"] * t["head_dim"]
    kv_dim = t["kv_heads"] * t["head_dim"]
    mlp = 3 * t["hidden"] * t["inter"]
    full_params = t["hidden"] * 2 * q_dim + 2 * t["hidden"] * kv_dim + q_dim * t["hidden"] + mlp  # q + gate
    k_dim, v_dim = t["lin_k_heads"] * t["lin_k_dim"], t["lin_v_heads"] * t["lin_v_dim"]
    gdn_params = (t["hidden"] * (2 * k_dim + 2 * v_dim) + t["hidden"] * 2 * t["lin_v_heads"]
                  + v_dim * t["hidden"] + mlp)  # in_proj_qkvz, in_proj_ba, out_proj, MLP
    lm_linear = full * full_params + gdn * gdn_params
    head = t["vocab"] * t["hidden"]
    vis_layer = 4 * v["hidden"] ** 2 + 2 * v["hidden"] * v["inter"]
    patch_in = 3 * v["temporal"] * v["patch"] ** 2
    merger_in = v["hidden"] * v["merge"] ** 2
    merger = merger_in * merger_in + merger_in * t["hidden"]
    return dict(full_layers=full, gdn_layers=gdn, lm_linear=lm_linear, head=head, vis_layer=vis_layer,
                patch_in=patch_in, merger=merger,
                kv_bytes_per_token=full * 2 * kv_dim * BF16,
                gdn_state_bytes=t["lin_v_heads"] * t["lin_k_dim"] * t["lin_v_dim"] * FP32,  # per layer, per sequence
                conv_state_bytes=(2 * k_dim + v_dim) * (t["conv"] - 1) * BF16)


def roofline(ceil: dict[str, Any], pre: dict[str, Any], dec: dict[str, Any], prompt: int, patches: int,
             image_tokens: int, out_tokens: int, batch: int, window_ctx: float) -> dict[str, Any]:
    s = shapes()
    t, v = TEXT, VISION
    peak = ceil["gemm_bf16_8192"]["tflops"] * 1e12
    bw = ceil["copy"]["gbps_read_plus_write"] * 1e9
    fa3 = ceil["vision_attention"]["FLASH_ATTN_fa3"]["tflops"] * 1e12
    pages_pf = pre["prompt_tokens_in_window"] / prompt
    pg = {g: d["ms"] for g, d in pre["groups"].items()}
    dg = {g: d["ms"] for g, d in dec["groups"].items()}
    steps = dec["steps"]
    steps_per_page = out_tokens / batch
    mean_ctx = prompt + out_tokens / 2

    def per_page_pre(*groups: str) -> float:
        return sum(pg.get(g, 0.0) for g in groups) / pages_pf

    def per_page_dec(*groups: str) -> float:
        return sum(dg.get(g, 0.0) for g in groups) / steps * steps_per_page

    rows = []

    def row(part: str, flops: float, byts: float, measured_ms: float, rate: float = peak, note: str = "") -> None:
        floor = max(flops / rate if flops else 0.0, byts / bw if byts else 0.0) * 1e3
        rows.append({"part": part, "gflop_per_page": round(flops / 1e9, 1), "gb_per_page": round(byts / 1e9, 2),
                     "floor_ms": round(floor, 2), "measured_ms": round(measured_ms, 2),
                     "of_limit_pct": round(100 * floor / measured_ms, 0) if measured_ms else None,
                     "bound": ("compute" if flops / rate >= byts / bw else "memory") if (flops or byts) else "",
                     "note": note})

    P, M, h = patches, image_tokens, v["hidden"]
    act = P * h * BF16
    row("vision encoder attention", v["depth"] * 4 * P * P * h, v["depth"] * 4 * act,
        per_page_pre("vision_attention"), rate=fa3,
        note=f"floor at FlashAttention 3's own rate at this shape ({fa3 / 1e12:.0f} TFLOP/s); "
             f"{100 * v['depth'] * 4 * P * P * h / peak * 1e3 / per_page_pre('vision_attention'):.0f} % of the GEMM rate")
    row("vision encoder GEMMs (qkv, proj, MLP, patch embed, merger)",
        2 * P * (v["depth"] * s["vis_layer"] + s["patch_in"] * h) + 2 * M * s["merger"],
        2 * (v["depth"] * s["vis_layer"] + s["merger"]) + v["depth"] * P * (6 * h + 2 * v["inter"]) * BF16,
        per_page_pre("vision_gemm"))
    row("vision encoder other (norms, GELU, adds, rotary, copies)", 0,
        v["depth"] * (20 * act + 2 * P * v["inter"] * BF16), per_page_pre("vision_other"),
        note="bytes estimated: ~20 passes over the activations and 2 over the MLP's per layer")
    row("LM prefill GEMMs", 2 * prompt * s["lm_linear"], 0, per_page_pre("lm_gemm", "lm_head_gemm"),
        note="window: 4 836 decoded tokens rode along with 315 541 prompt tokens (1.5 %)")
    gdn_prefill_bytes = s["gdn_layers"] * prompt * 130e3
    row("gated-delta-net prefill (chunked, Triton/FLA)", s["gdn_layers"] * prompt * 5.2e6, gdn_prefill_bytes,
        per_page_pre("gdn_prefill", "gdn_mixed"),
        note="estimate: ~130 kB a token a layer (fp32 chunk states, w/u, q/k/v/o), ~5 MFLOP a token a layer")
    row("full attention prefill (causal, 8 layers)",
        s["full_layers"] * 4 * t["heads"] * t["head_dim"] * prompt * prompt / 2, 0,
        per_page_pre("full_attention_mixed"), rate=fa3, note="floor at FA3's rate; includes the decodes riding along")
    row("LM prefill other (norms, SiLU, gating, rotary; fused Triton)", 0, t["layers"] * prompt * 100e3,
        per_page_pre("lm_other"), note="bytes estimated: ~100 kB a token a layer")
    pre_other = per_page_pre("input_prep", "sampling", "outside_steps")
    row("prefill: input preparation, sampling", 0, 0, pre_other)
    # decode
    attn_ms = per_page_dec("full_attention_decode") * mean_ctx / window_ctx
    row("full attention decode (KV cache reads)", 4 * t["heads"] * t["head_dim"] * s["full_layers"] * mean_ctx * out_tokens,
        out_tokens * mean_ctx * s["kv_bytes_per_token"], attn_ms,
        note=f"KV {s['kv_bytes_per_token'] / 1024:.0f} KiB a cached token; mean context {mean_ctx:.0f} "
             f"(window {window_ctx:.0f}, time scaled)")
    row("gated-delta-net decode (fp32 state read + write)", 0,
        out_tokens * s["gdn_layers"] * (2 * s["gdn_state_bytes"] + 2 * s["conv_state_bytes"]),
        per_page_dec("gdn_decode"), note=f"state {s['gdn_state_bytes'] / 2**20:.0f} MiB a layer a sequence (fp32)")
    row(f"LM decode GEMMs (batch {batch})", 2 * out_tokens * s["lm_linear"],
        steps_per_page * s["lm_linear"] * BF16, per_page_dec("lm_gemm"),
        note=f"M = {batch}: at the ridge point ({peak / bw:.0f} FLOP/B)")
    row("LM head (logits)", 2 * out_tokens * s["head"], steps_per_page * s["head"] * BF16,
        per_page_dec("lm_head_gemm"))
    row("decode other: norms, SiLU, sampling, input preparation", 0, 0,
        per_page_dec("lm_other", "sampling", "input_prep", "vision_other", "vision_attention", "outside_steps"))
    idle_dec = (dec["idle_between_steps_ms"] + dec["idle_inside_steps_ms"]) / steps * steps_per_page
    idle_pre = (pre["idle_between_steps_ms"] + pre["idle_inside_steps_ms"]) / pages_pf
    prompt_rows = rows[:8]
    decode_rows = rows[8:]
    totals = {
        "prompt_floor_ms": round(sum(r["floor_ms"] for r in prompt_rows), 1),
        "prompt_measured_ms": round(sum(r["measured_ms"] for r in prompt_rows), 1),
        "decode_floor_ms": round(sum(r["floor_ms"] for r in decode_rows), 1),
        "decode_measured_ms": round(sum(r["measured_ms"] for r in decode_rows), 1),
        "idle_prefill_window_ms_per_page": round(idle_pre, 1),
        "idle_decode_window_ms_per_page": round(idle_dec, 1),
    }
    totals["page_floor_ms"] = round(totals["prompt_floor_ms"] + totals["decode_floor_ms"], 1)
    totals["page_kernels_ms"] = round(totals["prompt_measured_ms"] + totals["decode_measured_ms"], 1)
    totals["pages_per_s_at_floor"] = round(1e3 / totals["page_floor_ms"], 2)
    totals["pages_per_s_if_never_idle"] = round(1e3 / totals["page_kernels_ms"], 2)
    return {"ceilings": {"gemm_bf16_tflops": peak / 1e12, "copy_gbps": bw / 1e9, "fa3_vision_tflops": fa3 / 1e12},
            "per_page": {"prompt_tokens": prompt, "patches": patches, "image_tokens": image_tokens,
                         "output_tokens": out_tokens, "batch": batch, "decode_steps_per_page": steps_per_page,
                         "mean_decode_context": mean_ctx, "window_context": window_ctx,
                         "pages_prefilled_in_prefill_window": round(pages_pf, 2), "decode_steps_in_window": steps},
            "model": {k: v for k, v in shapes().items()}, "rows": rows, "totals": totals}


def markdown(r: dict[str, Any]) -> str:
    lines = ["| part | GFLOP / page | GB / page | floor ms / page | measured ms / page | floor / measured | bound | note |",
             "|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        pct = f"{row['of_limit_pct']:.0f} %" if row["of_limit_pct"] is not None and row["floor_ms"] else "—"
        lines.append(f"| {row['part']} | {row['gflop_per_page'] or '—'} | {row['gb_per_page'] or '—'} | "
                     f"{row['floor_ms'] or '—'} | {row['measured_ms']} | {pct} | {row['bound']} | {row['note']} |")
    t = r["totals"]
    lines.append(f"\nprompt side: floor {t['prompt_floor_ms']} ms, kernels {t['prompt_measured_ms']} ms; decode: floor "
                 f"{t['decode_floor_ms']} ms, kernels {t['decode_measured_ms']} ms; page: floor {t['page_floor_ms']} ms "
                 f"({t['pages_per_s_at_floor']} pages/s), kernels {t['page_kernels_ms']} ms "
                 f"({t['pages_per_s_if_never_idle']} pages/s if the GPU were never idle); idle in the windows "
                 f"{t['idle_prefill_window_ms_per_page']} ms (prefill) + {t['idle_decode_window_ms_per_page']} ms "
                 f"(decode, profiler-inflated) a page")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ceilings", required=True)
    ap.add_argument("--prefill", required=True, help="profile summary of a prefill-heavy window")
    ap.add_argument("--decode", required=True, help="profile summary of a decode-only window")
    ap.add_argument("--prompt-tokens", type=int, default=5017)
    ap.add_argument("--patches", type=int, default=102 * 132)
    ap.add_argument("--image-tokens", type=int, default=51 * 66)
    ap.add_argument("--output-tokens", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=192)
    ap.add_argument("--window-context", type=float, default=5670,
                    help="mean context of the sequences in the decode window (prompt + tokens decoded so far)")
    ap.add_argument("--out")
    a = ap.parse_args()
    load = lambda p: json.load(open(p))  # noqa: E731
    r = roofline(load(a.ceilings), load(a.prefill), load(a.decode), a.prompt_tokens, a.patches, a.image_tokens,
                 a.output_tokens, a.batch, a.window_context)
    if a.out:
        with open(a.out, "w") as handle:
            json.dump(r, handle, indent=1)
    print(markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
