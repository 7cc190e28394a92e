"""The bounded template sandbox: every way of making a huge value in one step is refused before it is
made, runaway loops are stopped at the deadline, and real templates render exactly as jinja2's own
sandbox renders them (the reference: an ImmutableSandboxedEnvironment with transformers' settings)."""

import json
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from astrai.text.sandbox import MAX_VALUE, TemplateLimit
from astrai.text.template import TEMPLATE_DIR, ChatTemplate

MSGS = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello, how are you?"}]
FIXTURE = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "chat_templates.json"

# each makes (or would make) far more than MAX_VALUE characters in one C-level step
SIZE_BOMBS = {
    "str_times": "{{ 'a' * 3000000000 }}",
    "str_times_pow": "{{ 'ab' * 10 ** 10 }}",
    "list_times": "{{ ([0] * 3000000000)|length }}",
    "list_of_big_times": "{% set s = 'a' * 1000000 %}{{ ([s] * 1000)|length }}",
    "percent_width": "{{ '%3000000000s' % 'a' }}",
    "percent_star": "{{ '%*s' % (3000000000, 'a') }}",
    "format_filter": "{{ '%3000000000d'|format(1) }}",
    "brace_format": "{{ '{:>3000000000}'.format('a') }}",
    "brace_nested": "{{ '{:>{w}}'.format('a', w=3000000000) }}",
    "center_filter": "{{ 'a'|center(3000000000) }}",
    "ljust_method": "{{ 'a'.ljust(3000000000) }}",
    "zfill_method": "{{ '1'.zfill(3000000000) }}",
    "expandtabs": "{{ ('\\t' * 1000000).expandtabs(1000000) }}",
    "replace_empty": "{{ ('a' * 1000000)|replace('', 'xxxxxxxxxxxxxxxxxxxxxxxxxx') }}",
    "indent_wide": "{{ ('\\n' * 1000000)|indent('x' * 1000000) }}",
    "join_refs": "{% set s = 'a' * 10000000 %}{{ [s, s, s, s]|join }}",
    "tilde_chain": "{% set s = 'a' * 10000000 %}{{ s ~ s ~ s ~ s }}",
    "plus_chain": "{% set s = 'a' * 10000000 %}{{ s + s + s + s }}",
    "output_refs": "{% set s = 'a' * 10000000 %}{{ [s, s, s, s] }}",
    "tojson_refs": "{% set s = 'a' * 10000000 %}{{ [s, s, s, s]|tojson }}",
    "fromkeys": "{% set s = 'a' * 1000000 %}{{ dict.fromkeys(range(100), s) }}",
    "macro_doubling": "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}"
                      "{% endmacro %}{{ d('a', 40) }}",
    "namespace_doubling": "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                          "{% endfor %}{{ ns.s|length }}",
    "macro_buffer": "{% set s = 'a' * 10000000 %}{% macro m() %}{% for i in range(100) %}{{ s }}{% endfor %}"
                    "{% endmacro %}{{ m()|length }}",
    "set_block": "{% set s = 'a' * 10000000 %}{% set b %}{% for i in range(100) %}{{ s }}{% endfor %}{% endset %}"
                 "{{ b|length }}",
    "int_power": "{{ 10 ** (10 ** 10) }}",
    "int_squaring": "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}"
                    "{{ ns.x }}",
    "lipsum": "{{ lipsum(100000, max=1000) }}",
    "output_total": "{% set s = 'a' * 10000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(SIZE_BOMBS))
def test_size_bombs_are_refused_before_the_memory_is_taken(name):
    tracemalloc.start()
    try:
        with pytest.raises(TemplateLimit) as e:
            ChatTemplate(SIZE_BOMBS[name], name).render(MSGS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(e.value).startswith(f"chat template {name}: ")
    # the operands a bomb starts from (up to 4 x 10M characters), never its result
    assert peak < 8 * MAX_VALUE, f"{name}: {peak / 2 ** 20:.0f} MiB allocated"


@pytest.mark.parametrize("src", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # no call, no output
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
])
def test_loops_without_bound_stop_at_the_deadline(src, monkeypatch):
    monkeypatch.setenv("ASTRAI_TEMPLATE_TIMEOUT_S", "1")
    t0 = time.monotonic()
    with pytest.raises(TemplateLimit, match="rendering took more than 1 s"):
        ChatTemplate(src, "loop").render(MSGS)
    assert time.monotonic() - t0 < 10
    # the thread is usable afterwards: no stop left pending for a later render
    assert ChatTemplate("{{ messages[0].content }}", "ok").render(MSGS) == "hi there"


def test_deadline_is_per_thread():
    """A runaway render in one thread stops there; another thread's renders go on."""
    errors, done = [], []

    def runaway():
        try:
            ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                         "loop").render(MSGS)
        except TemplateLimit as e:
            errors.append(e)

    import os

    os.environ["ASTRAI_TEMPLATE_TIMEOUT_S"] = "1"
    try:
        t = threading.Thread(target=runaway)
        t.start()
        while t.is_alive():
            done.append(ChatTemplate("{{ messages|length }}", "quick").render(MSGS))
        t.join()
    finally:
        del os.environ["ASTRAI_TEMPLATE_TIMEOUT_S"]
    assert len(errors) == 1 and done and set(done) == {"2"}


def _plain_environment():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from astrai.text.template import _environment

    generation = next(type(e) for e in _environment().extensions.values() if "generation" in getattr(e, "tags", ()))
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, generation])
    for name in ("raise_exception", "strftime_now", "dict", "namespace"):
        env.globals[name] = _environment().globals[name]
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    return env


def test_real_templates_render_as_jinja2s_own_sandbox(chitchat_chats):
    """Bounds change no output: every fixture family and the bundled templates, on real conversations
    (with a system prompt where the family takes one), against an unbounded jinja2 sandbox."""
    families = json.loads(FIXTURE.read_text())["families"]
    sources = {name: f["template"] for name, f in families.items()}
    sources.update({p.stem: p.read_text() for p in TEMPLATE_DIR.glob("*.jinja")})
    plain = _plain_environment()
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    chats = chitchat_chats(20)
    checked = 0
    for name, src in sorted(sources.items()):
        ours, ref = ChatTemplate(src, name), plain.from_string(src)
        for chat in chats:
            for msgs, gen in ((chat, False), (chat[:-1], True), ([{"role": "system", "content": "Be brief."}] + chat, False)):
                try:
                    want = ref.render(messages=msgs, tools=None, documents=None, add_generation_prompt=gen, **specials)
                except Exception:
                    continue  # the family refuses this shape (no system role, ...): nothing to compare
                assert ours.render(msgs, add_generation_prompt=gen, special_tokens=specials) == want, name
                checked += 1
    assert checked > 20 * len(sources)
