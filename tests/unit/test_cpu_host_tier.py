"""On a CPU the host tier is the same RAM as the device KV: `serve` folds a full-precision one into the device."""

from __future__ import annotations

from sessionserve.config import Config, fold_cpu_host_tier

MiB = 1 << 20


def test_a_full_precision_host_tier_on_a_cpu_joins_the_device_kv() -> None:
    config = Config.from_kwargs(kv_cache_bytes=192 * MiB, host_kv_bytes=64 * MiB)
    folded, note = fold_cpu_host_tier(config, "cpu")
    assert folded.cache.kv_cache_bytes == 256 * MiB and folded.session.host_kv_bytes == 0
    assert note is not None and "added to the device KV" in note and "--host-kv-int8" in note
    # Nothing else changes.
    assert folded.scheduler == config.scheduler and folded.model == config.model
    assert folded.session.residency_policy == config.session.residency_policy


def test_the_tier_stays_where_it_adds_capacity_or_memory() -> None:
    gpu = Config.from_kwargs(kv_cache_bytes=192 * MiB, host_kv_bytes=64 * MiB)
    assert fold_cpu_host_tier(gpu, "cuda") == (gpu, None)  # host memory the device does not have
    int8 = Config.from_kwargs(kv_cache_bytes=192 * MiB, host_kv_bytes=64 * MiB, host_kv_int8=True)
    assert fold_cpu_host_tier(int8, "cpu") == (int8, None)  # ~4x the tokens per byte
    none = Config.from_kwargs(kv_cache_bytes=192 * MiB, host_kv_bytes=0)
    assert fold_cpu_host_tier(none, "cpu") == (none, None)
    blocks = Config.from_kwargs(num_blocks=64, host_kv_bytes=64 * MiB)  # an explicit block count is kept as given
    assert fold_cpu_host_tier(blocks, "cpu") == (blocks, None)
