"""`astrai serve BASE --lora name=DIR ...`: the adapters listed by /v1/models, chosen by the request's
`model`, batched together, each answer equal to that adapter merged into the base and served alone
(greedy); a model id not served is a 404 naming what is; bad --lora values are refused at start."""

import concurrent.futures

import pytest

from lora_random import random_adapter
from serving import ServerProcess

from astrai.model.adapter_files import save_adapter
from astrai.model.lora import LoraSpec

openai = pytest.importorskip("openai")


def _adapter(base, path, spec, seed):
    save_adapter(random_adapter(base, spec, seed, std=0.5), path)
    return path


@pytest.fixture(scope="module")
def adapters(serve_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    return {"alpha": _adapter(serve_checkpoint, root / "alpha", LoraSpec(4, 8.0), 1),
            "beta": _adapter(serve_checkpoint, root / "beta", LoraSpec(8, 8.0, targets=("q_proj", "v_proj", "up_proj")),
                             2)}


def _client(server):
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


def _answers(client, model, prompts):
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: they share engine steps
        futs = [pool.submit(client.completions.create, model=model, prompt=p, max_tokens=8, temperature=0)
                for p in prompts]
        return [f.result().choices[0].text for f in futs]


def test_each_adapter_answers_as_if_merged_and_served_alone(serve_checkpoint, adapters):
    prompts = ["hello there", "what is up", "tell me more", "hello there again"]
    many = ServerProcess(serve_checkpoint, "--served-model-name", "base", "--page-size", "4",
                         *[a for name, d in adapters.items() for a in ("--lora", f"{name}={d}")])
    try:
        client = _client(many)
        assert [m.id for m in client.models.list().data] == ["base", "alpha", "beta"]
        mixed = {}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # the three models' requests at once
            futs = {name: pool.submit(_answers, client, name, prompts) for name in ("base", "alpha", "beta")}
            mixed = {name: f.result() for name, f in futs.items()}
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="gamma", prompt="hi", max_tokens=2)
        assert "`base`, `alpha`, `beta`" in str(e.value)
        metrics = many.text("/metrics")
        assert 'astrai_model_requests_total{model="alpha"} 4.0' in metrics
    finally:
        assert many.stop() == 0
    alone = {"base": serve_checkpoint, **adapters}
    for name, path in alone.items():
        single = ServerProcess(path, "--served-model-name", name)
        try:
            assert _answers(_client(single), name, prompts) == mixed[name], name
        finally:
            assert single.stop() == 0
    assert len({tuple(v) for v in mixed.values()}) == 3  # the adapters change the answers


def test_bad_lora_values_are_refused_at_start(serve_checkpoint, adapters, tmp_path):
    import subprocess
    import sys

    from serving import ROOT

    def start(*args):
        return subprocess.run([sys.executable, "-m", "astrai.cli", "serve", str(serve_checkpoint), "--port", "0",
                               "--device", "cpu", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)

    r = start("--lora", "noequals")
    assert r.returncode != 0 and "expected NAME=DIR" in r.stderr
    r = start("--lora", f"x={adapters['alpha']}", "--lora", f"x={adapters['beta']}")
    assert r.returncode != 0 and "given twice" in r.stderr
    r = start("--lora", f"x={tmp_path / 'missing'}")
    assert r.returncode != 0 and r.stderr.startswith("error:") and "Traceback" not in r.stderr
