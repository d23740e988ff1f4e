#!/usr/bin/env python
"""Write a tiny random-weight Qwen3-VL / Qwen3.5 model directory that vLLM loads offline.

Usage: python scripts/make_tiny_model.py OUT_DIR [--arch tiny-qwen3vl|tiny-qwen3_5]

The directory holds config.json, generation_config.json, model.safetensors (random
bf16 weights, ~2 MB, so no load_format="dummy" is needed), a small byte-level BPE
tokenizer with the Qwen special tokens (tokenizer.json, tokenizer_config.json,
chat_template.jinja) and the processor configs (processor_config.json plus the legacy
preprocessor_config.json / video_preprocessor_config.json). The processor configs are
written as plain JSON, so this script needs neither torchvision nor a hub. The config's
vocab_size equals the tokenizer's size, so every id the random model samples decodes.
Same output bytes for the same transformers/torch/tokenizers versions.
Adapted from shared/device/make_model.py (tiny archs only).
"""
import argparse
import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIALS = [  # ids 0..13 in the trained tokenizer
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
# Same pre-tokenizer regex as transformers' Qwen2/Qwen3.5 tokenizers.
QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
              r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "Invoice number total amount due date page table header footer section figure",
    "<html><body><p>Hello world</p><table><tr><td>cell</td></tr></table></body></html>",
    "# Title\n\nSome **markdown** text with a [link](http://x.y) and $x^2$.",
    "OCR this image to HTML. Keep the layout, tables, math and reading order.",
] * 50
# Qwen-style template; an image becomes <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Processor defaults (callers override per engine with mm_processor_kwargs min/max_pixels).
VISION_COMMON = dict(patch_size=16, merge_size=2, temporal_patch_size=2,
                     image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
IMAGE_PROCESSOR = dict(VISION_COMMON, image_processor_type="Qwen2VLImageProcessor",
                       do_convert_rgb=True, do_normalize=True, do_rescale=True, do_resize=True,
                       resample=3, rescale_factor=1 / 255,
                       size={"shortest_edge": 3136, "longest_edge": 6_291_456})
VIDEO_PROCESSOR = dict(VISION_COMMON, video_processor_type="Qwen3VLVideoProcessor",
                       size={"shortest_edge": 4096, "longest_edge": 25_165_824})

ARCHS = {
    "tiny-qwen3vl": dict(
        family="qwen3_vl", mrope=[6, 5, 5], rope_theta=5_000_000.0,
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32),
        vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                    deepstack_visual_indexes=[1])),
    "tiny-qwen3_5": dict(  # attn head_dim 64 (CPU attn: 32..256); 1 full-attn layer of 4
        family="qwen3_5", mrope=[3, 3, 2], rope_theta=10_000_000,  # sum = head_dim*0.25/2
        text=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                  linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=128, linear_value_head_dim=128),  # CPU GDN: 32 fails
        vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2)),
}


def build_tokenizer():
    """Byte-level BPE trained on CORPUS (1024 tokens), Qwen specials at ids 0..13."""
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE(unk_token=None))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=1024, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, additional_special_tokens=SPECIALS[1:], model_max_length=262144)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_config(arch, ids, vocab_size):
    spec = ARCHS[arch]
    text = dict(spec["text"], vocab_size=vocab_size, hidden_act="silu", rms_norm_eps=1e-6,
                max_position_embeddings=262144, tie_word_embeddings=False,
                attention_bias=False, dtype="bfloat16", bos_token_id=None,
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    rope = {"rope_type": "default", "rope_theta": spec["rope_theta"],
            "mrope_section": spec["mrope"], "mrope_interleaved": True}
    vision = dict(spec["vision"], hidden_act="gelu_pytorch_tanh", in_channels=3, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                  out_hidden_size=text["hidden_size"], initializer_range=0.02)
    if spec["family"] == "qwen3_vl":
        from transformers import Qwen3VLConfig as Cfg
        arch_name = "Qwen3VLForConditionalGeneration"
    else:  # Qwen3.5: Gated DeltaNet layers + a full-attention layer every 4th
        from transformers import Qwen3_5Config as Cfg
        arch_name = "Qwen3_5ForConditionalGeneration"
        n = text["num_hidden_layers"]
        rope["partial_rotary_factor"] = 0.25
        text.update(linear_conv_kernel_dim=4, full_attention_interval=4,
                    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                 for i in range(n)],
                    attn_output_gate=True, mamba_ssm_dtype="float32")
    text["rope_parameters"] = rope
    cfg = Cfg(text_config=text, vision_config=vision,
              image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
              vision_start_token_id=ids["<|vision_start|>"],
              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    cfg.architectures = [arch_name]
    cfg.dtype = "bfloat16"
    return cfg


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--arch", default="tiny-qwen3vl", choices=sorted(ARCHS))
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)

    import torch
    import transformers

    tok = build_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    assert all(ids[t] == i for i, t in enumerate(SPECIALS)), ids
    tok.save_pretrained(a.out_dir)
    write_json(os.path.join(a.out_dir, "processor_config.json"),
               {"processor_class": "Qwen3VLProcessor",
                "image_processor": IMAGE_PROCESSOR, "video_processor": VIDEO_PROCESSOR})
    write_json(os.path.join(a.out_dir, "preprocessor_config.json"),
               dict(IMAGE_PROCESSOR, processor_class="Qwen3VLProcessor"))
    write_json(os.path.join(a.out_dir, "video_preprocessor_config.json"),
               dict(VIDEO_PROCESSOR, processor_class="Qwen3VLProcessor"))

    cfg = build_config(a.arch, ids, len(tok))
    torch.manual_seed(0)
    model = getattr(transformers, cfg.architectures[0])(cfg).to(torch.bfloat16).eval()
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"], do_sample=False)
    model.save_pretrained(a.out_dir)  # config.json, generation_config.json, model.safetensors

    size = sum(os.path.getsize(os.path.join(a.out_dir, f)) for f in os.listdir(a.out_dir))
    print(json.dumps({"out": a.out_dir, "arch": a.arch, "architectures": cfg.architectures,
                      "vocab_size": len(tok), "params": sum(p.numel() for p in model.parameters()),
                      "dir_mb": round(size / 1e6, 2),
                      "special_ids": {k: ids[k] for k in SPECIALS[9:]}}))


if __name__ == "__main__":
    main()
