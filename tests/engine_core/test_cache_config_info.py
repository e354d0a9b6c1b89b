"""vLLM's cache_config_info metric: the labels the EngineCore makes of its config and KV
cache (--kv-cache-dtype among them), and the gauge the server renders from its stats."""

from prometheus_client.parser import text_string_to_metric_families

from engine_core.scheduler_stats import cache_config_info
from ipc.config import EngineConfig
from ipc.messages import SchedulerStats
from kv_cache import KVCacheManager
from server.metrics import ServerMetrics


def test_cache_config_info_labels_and_metric():
    config = EngineConfig(
        max_model_len=64, kv_cache_dtype="fp8", block_size=8, kv_cache_memory=1 << 20
    )
    manager = KVCacheManager(100, 8, 64, num_host_blocks=30)
    info = cache_config_info(config, manager)
    assert info == {
        "block_size": "8",
        "cache_dtype": "fp8",
        "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9",
        "kv_cache_memory_bytes": str(1 << 20),
        "num_cpu_blocks": "30",
        "num_gpu_blocks": "100",
        "num_gpu_blocks_override": "None",
    }
    metrics = ServerMetrics("tiny")
    text = metrics.render([SchedulerStats(cache_config_info=info)]).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families["splitserve:cache_config_info"].samples
    assert sample.value == 1.0 and sample.labels == {"model_name": "tiny", "engine": "0", **info}
    text = metrics.render([SchedulerStats()]).decode()
    assert "cache_config_info" not in text
