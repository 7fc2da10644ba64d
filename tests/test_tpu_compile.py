"""The Pallas attention kernels compile for the target TPU topology with libtpu, on this CPU."""

from __future__ import annotations

import pytest

from xtrain.plan import model_shape, resolve
from xtrain.tpu_compile import compile_kernel, kernel_requests


@pytest.fixture
def v6e4_16k(compose_config):
    cfg = compose_config(["hardware=v6e4", "model=d16", "data=cpp16k", "model.window_pattern=SSSL",
                          "model.window_len=1024"])
    plan = resolve(cfg, 4)
    return cfg, plan


def test_requests_cover_flash_and_the_windowed_splash_layers(v6e4_16k):
    cfg, plan = v6e4_16k
    reqs = kernel_requests(cfg.hardware, model_shape(cfg.model), plan.attention, 1)
    assert plan.attention == "flash"
    assert [(r["kernel"], r["window"]) for r in reqs] == [("flash", None), ("splash", 1024)]
    assert reqs[0]["shape"] == [1, 8, 16384, 128]
    assert reqs[0]["topology"] == {"platform": "tpu", "topology_name": "v6e:2x2"}


def test_sdpa_configs_need_no_kernel(compose_config):
    cfg = compose_config(["hardware=v5e8", "model=d16", "data=base_data_v3"])
    plan = resolve(cfg, 8)
    assert kernel_requests(cfg.hardware, model_shape(cfg.model), plan.attention, 8) == []


def test_kernels_compile_for_v6e_with_the_pinned_jax_and_libtpu(v6e4_16k):
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    cfg, plan = v6e4_16k
    for req in kernel_requests(cfg.hardware, model_shape(cfg.model), plan.attention, 1):
        req["shape"][2] = 2048  # the real kernels at a shorter length keep the test quick
        if req["window"]:
            req["window"] = 512
        result = compile_kernel(req)
        assert result["ok"], result
        assert result["jax"] == "0.7.0" and result["argument_bytes"] > 0


def test_a_compiler_failure_is_reported_not_raised(v6e4_16k):
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    cfg, plan = v6e4_16k
    (req, *_) = kernel_requests(cfg.hardware, model_shape(cfg.model), plan.attention, 1)
    req["topology"]["topology_name"] = "v6e:3x3x3"  # no such slice
    result = compile_kernel(req)
    assert result["ok"] is False and 'Topology layout "v6e:3x3x3"' in result["error"]  # libtpu's words
