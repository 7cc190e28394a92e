"""/health and /metrics: the exposition read back by prometheus_client's text parser, and counters that move
exactly as much as the requests sent (and their usage, as the client received it) say they should."""

import pytest

openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")


def scrape(server) -> dict:
    """{(sample name, frozenset(labels)): value} from prometheus_client's text parser."""
    out = {}
    for family in parser.text_string_to_metric_families(server.text("/metrics")):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m, name, **labels):
    return m[(name, frozenset(labels.items()))]


def test_health_reports_the_pool(server):
    h = server.idle_health()
    assert set(h) == {"status", "running", "waiting", "kv_tokens_total", "kv_tokens_free", "kv_tokens_cached"}
    assert h["status"] == "ok" and h["kv_tokens_total"] == 16384  # --kv-cache-tokens of the fixture (page multiple)
    assert h["kv_tokens_free"] + h["kv_tokens_cached"] == h["kv_tokens_total"]


def test_metrics_count_what_was_served(server, client, serve_checkpoint):
    before = scrape(server)
    usages = []
    for prompt, n in (("hello world how", 5), ("the lazy dog", 9)):
        r = client.completions.create(model=str(serve_checkpoint), prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True})
        usages.append(r.usage)
    stream = client.chat.completions.create(model=str(serve_checkpoint), max_tokens=4, stream=True,
                                            messages=[{"role": "user", "content": "hello"}],
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usages.append([c for c in stream][-1].usage)
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("astrai_requests_total", finish_reason="length") == 3
    assert delta("astrai_generation_tokens_total") == sum(u.completion_tokens for u in usages) == 18
    assert delta("astrai_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("astrai_time_to_first_token_seconds_count") == 3
    assert delta("astrai_inter_token_latency_seconds_count") == 18 - 3
    for hist in ("astrai_time_to_first_token_seconds", "astrai_inter_token_latency_seconds"):
        buckets = sorted((float(dict(k[1])["le"]), v) for k, v in after.items() if k[0] == hist + "_bucket")
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == float("inf")
        assert counts[-1] == value(after, hist + "_count") and value(after, hist + "_sum") > 0
    h = server.idle_health()
    assert value(after, "astrai_kv_tokens_total") == h["kv_tokens_total"]
    assert value(after, "astrai_requests_running") == 0 and value(after, "astrai_requests_waiting") == 0
    queried, hit = value(after, "astrai_prefix_cache_queried_tokens_total"), value(after, "astrai_prefix_cache_hit_tokens_total")
    assert 0 <= hit <= queried and value(after, "astrai_prefix_cache_hit_rate") == pytest.approx(hit / queried)
