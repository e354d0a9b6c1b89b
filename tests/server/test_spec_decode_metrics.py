"""The spec_decode_* metrics from SchedulerStats (vLLM's names and labels), and the
EngineCore's stats line for them."""

from prometheus_client.parser import text_string_to_metric_families

from engine_core.spec_decode import spec_decode_summary
from ipc.messages import SchedulerStats
from server.metrics import ServerMetrics


def spec_stats(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]):
    return SchedulerStats(
        spec_decode_num_drafts=drafts,
        spec_decode_num_draft_tokens=draft_tokens,
        spec_decode_num_accepted_tokens=accepted,
        spec_decode_num_accepted_tokens_per_pos=per_pos,
    )


def test_spec_decode_counters_have_vllm_names_and_positions():
    stats = spec_stats(10, 30, 12, [7, 4, 1])
    text = ServerMetrics("m").render([stats]).decode()
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("splitserve:spec_decode")
    }
    prefix = "splitserve:spec_decode_num_"
    assert samples == {
        (prefix + "drafts_total", None): 10,
        (prefix + "draft_tokens_total", None): 30,
        (prefix + "accepted_tokens_total", None): 12,
        (prefix + "accepted_tokens_per_pos_total", "0"): 7,
        (prefix + "accepted_tokens_per_pos_total", "1"): 4,
        (prefix + "accepted_tokens_per_pos_total", "2"): 1,
    }
    assert "spec_decode" not in ServerMetrics("m").render([SchedulerStats()]).decode()


def test_the_stats_line_gives_acceptance_over_the_interval():
    before = spec_stats(2, 6, 3, [2, 1, 0])
    now = spec_stats(6, 18, 9, [6, 2, 1])
    assert spec_decode_summary(before, now) == (
        "acceptance rate 50.0%, mean acceptance length 2.50, 4 drafts, 12 draft tokens, "
        "6 accepted; per position 1.00, 0.25, 0.25"
    )
    assert spec_decode_summary(now, now) == "no drafts"


def test_every_engine_has_its_own_samples():
    """With data parallelism each engine's stats carry its index as the engine label; an
    engine that did not answer has none."""
    text = ServerMetrics("m").render(
        [spec_stats(1, 2, 1, [1]), None, SchedulerStats(num_running=3)]
    )
    running = {
        s.labels["engine"]: s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if s.name == "splitserve:num_requests_running"
    }
    drafts = [
        s.labels["engine"]
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if s.name == "splitserve:spec_decode_num_drafts_total"
    ]
    assert running == {"0": 0.0, "2": 3.0} and drafts == ["0"]
