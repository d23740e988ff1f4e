"""GPU layouts → engine arguments: every layout is checked here, since CI has no GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from chandrad.config import EngineSettings
from chandrad.engine import pages_in_flight
from chandrad.engine.layout import plan_engines
from chandrad.errors import ConfigError

EC = Path("/var/lib/chandrad/ec_cache")


def plan(**settings: object):
    return plan_engines(EngineSettings(**settings), EC)  # type: ignore[arg-type]


def test_single_carries_chandras_serving_settings():
    [spec] = plan()
    args = spec.engine_args
    assert spec.gpus == (0,) and spec.role == "generate"
    assert args["model"] == "datalab-to/chandra-ocr-2" and args["max_model_len"] == 18000
    assert args["limit_mm_per_prompt"] == {"image": 1, "video": 0}
    assert args["mm_processor_kwargs"] == {"size": {"shortest_edge": 3136, "longest_edge": 6291456}}
    assert args["enable_prefix_caching"] is True and args["gpu_memory_utilization"] == 0.85
    assert spec.env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_replicas_start_one_engine_per_gpu():
    specs = plan(gpus=(2, 3), layout="replicas")
    assert [(s.name, s.cuda_visible_devices) for s in specs] == [("engine-gpu2", "2"), ("engine-gpu3", "3")]
    assert all("data_parallel_size" not in s.engine_args for s in specs)


def test_data_parallel_is_one_front_end_over_all_gpus():
    [spec] = plan(gpus=(0, 1), layout="data-parallel")
    assert spec.engine_args["data_parallel_size"] == 2 and spec.cuda_visible_devices == "0,1"


def test_tensor_parallel_keeps_the_vision_encoder_data_parallel_and_drops_expandable_segments():
    [spec] = plan(gpus=(0, 1), layout="tensor-parallel")
    assert spec.engine_args["tensor_parallel_size"] == 2 and spec.engine_args["mm_encoder_tp_mode"] == "data"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in spec.env


def test_encoder_split_is_an_ec_producer_feeding_an_ec_consumer():
    encoder, language = plan(gpus=(0, 1), layout="encoder-split")
    assert (encoder.role, encoder.gpus, language.role, language.gpus) == ("encoder", (0,), "generate", (1,))
    producer, consumer = encoder.engine_args["ec_transfer_config"], language.engine_args["ec_transfer_config"]
    assert producer["ec_role"] == "ec_producer" and consumer["ec_role"] == "ec_consumer"
    assert producer["ec_connector"] == consumer["ec_connector"] == "ECExampleConnector"
    assert producer["ec_connector_extra_config"] == {"shared_storage_path": str(EC)}
    assert encoder.engine_args["mm_encoder_only"] is True
    assert encoder.engine_args["mm_processor_kwargs"] == language.engine_args["mm_processor_kwargs"], (
        "both sides must hash images alike"
    )
    # vLLM 0.26 keeps the image ids chandrad gives only where a cache is on: a small one on the
    # encoder (one renderer thread, as vLLM's cache wants), prefix caching on the language model.
    assert encoder.engine_args["mm_processor_cache_gb"] > 0 and encoder.engine_args["renderer_num_workers"] == 1
    assert language.engine_args["enable_prefix_caching"] is True


def test_engine_args_pass_through_and_win():
    [spec] = plan(engine_args={"max_num_seqs": 7, "gdn_prefill_backend": "triton"}, kv_cache_memory_gb=0.5)
    assert spec.engine_args["max_num_seqs"] == 7 and spec.engine_args["gdn_prefill_backend"] == "triton"
    assert spec.engine_args["kv_cache_memory_bytes"] == 2**29


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"gpus": (0, 1), "layout": "single"}, 'layout = "single" uses one GPU'),
        ({"gpus": (0,), "layout": "data-parallel"}, "needs at least two GPUs"),
        ({"gpus": (0, 1, 2), "layout": "encoder-split"}, "exactly two GPUs"),
        ({"gpus": (0, 1), "layout": "encoder-split", "enable_prefix_caching": False}, "enable_prefix_caching = true"),
        ({"gpus": (0, 1, 2), "layout": "tensor-parallel"}, "power-of-two"),
        ({"gpus": (1, 1), "layout": "replicas"}, "twice"),
        ({"gpus": ()}, "empty"),
    ],
)
def test_impossible_layouts_are_refused_at_startup(settings, message):
    with pytest.raises(ConfigError, match=message):
        plan(**settings)


def test_auto_layout_is_single_on_one_gpu_and_replicas_on_several():
    assert EngineSettings().layout == "single"
    assert EngineSettings(gpus=(0, 1)).layout == "replicas"
    assert [spec.gpus for spec in plan(gpus=(0, 1))] == [(0,), (1,)]


def test_pages_in_flight_default_follows_the_engine():
    assert pages_in_flight(EngineSettings(max_num_seqs=64), "vllm") == 64
    assert pages_in_flight(EngineSettings(max_num_seqs=64, gpus=(0, 1), layout="replicas"), "vllm") == 128
    assert pages_in_flight(EngineSettings(max_pages_in_flight=5), "vllm") == 5
    assert pages_in_flight(EngineSettings(), "tesseract") == (os.cpu_count() or 1)


def test_every_engine_start_uses_one_triton_cache_unless_the_admin_chose_one(monkeypatch, tmp_path):
    # Unset, inductor moved Triton's cache under its own on cold starts only, so the kernels vLLM's
    # profile run compiled were missing at the first warm start after a cold one (80-97 s on an H200).
    import os

    from chandrad.engine.vllm import set_spawn_environment

    spec = plan(kind="vllm")[0]
    monkeypatch.setattr(os, "environ", {"HOME": str(tmp_path), "TRITON_HOME": str(tmp_path / "th")})
    set_spawn_environment(spec)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "th" / ".triton" / "cache")
    monkeypatch.setattr(os, "environ", {"TRITON_CACHE_DIR": "/var/cache/chandrad/triton"})  # the systemd unit's
    set_spawn_environment(spec)
    assert os.environ["TRITON_CACHE_DIR"] == "/var/cache/chandrad/triton"
