"""Chat-template bombs: each is refused with one line within the render limits, never a hang, a memory blow-up or a
traceback; the sandbox still keeps templates away from Python internals."""

import json
import shutil
import time

import pytest

from qwenrt.template import TemplateEnvironment, TemplateLimits, compile_template, render_template
from qwenrt.tokenizer import Tokenizer
from tests.hostile import one_line_error
from tests.tokenizer_fixture import qwen35_tokenizer_dir

BIG = "{% set big = 'x' * 1000000 %}"
BOMBS = [
    ("{{ 'x' * 10**10 }}", "repeating a sequence"),
    ("{{ 'x' * 10000000000 }}", "repeating a sequence"),  # a literal: not folded at compile time either
    ("{% set l = [1] * 10**9 %}", "repeating a sequence"),
    ("{{ 2**(2**40) }}", "bits"),
    ("{{ 10**5000 }}", "bits"),
    ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}", "bits"),
    ("{{ lipsum(n=10**7) }}", "exceeds"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "iterations"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}", "limits"),
    ("{% for i in range(99999) recursive %}{{ loop(range(99999)) }}{% endfor %}", "recursion"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "exceed"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "exceed"),
    ("{% set ns = namespace(s='aa') %}{% for i in range(64) %}{% set ns.s = ns.s|replace('a', 'aa') %}{% endfor %}",
     "replace would exceed"),
    ("{{ ('a' * 1000000)|replace('', 'bbbbbbbbbb') }}", "replace would exceed"),
    ("{{ 'x'|center(10**10) }}", "exceeds"),
    ("{{ 'x'.ljust(999999999) }}", "exceeds"),
    ("{{ ('a\\n' * 1000)|indent(999999, true) }}", "indent would exceed"),
    ("{{ '\\t\\t'.expandtabs(999999) * 100 }}", "exceed"),
    ("{{ '%999999999d' % 1 }}", "format width"),
    ("{{ '%*d' % (999999999, 1) }}", "format width"),
    ("{{ '%999999999d'|format(1) }}", "format width"),
    ("{{ '{:>999999999}'.format(1) }}", "format width"),
    ("{{ '{:>{}}'.format(1, 999999) }}", "nested format"),
    (BIG + "{{ ([big] * 1000000)|join }}", "exceed"),
    (BIG + "{{ ([big] * 1000)|tojson }}", "exceed"),
    (BIG + "{{ ([big] * 1000)|string }}", "exceed"),
    (BIG + "{{ [[big] * 100] * 100 }}", "exceed"),
    ("{% set x %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}", "output would exceed"),
    ("{% for i in range(100000) %}" + "z" * 1000 + "{% endfor %}", "output would exceed"),
    ("{{ [1, 2, 3]|batch(10**9, 0)|list }}", "exceeds"),
    ("{{ {'a': 1}|tojson(indent=10**6) }}", "exceeds"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ 2.0 ** 100000 }}", "OverflowError"),
    ("{{ range(10**6) }}", "MAX_RANGE"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),
    ("{{ messages.append(1) }}", "unsafe"),
    ("{% set ns = namespace() %}{% set ns.__class__ = 1 %}", "cannot set namespace attribute"),
    ("{{ raise_exception('no') }}", "no"),
    ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "nested too deeply"),
]


@pytest.mark.parametrize("source, fragment", BOMBS, ids=[b[0][:40] for b in BOMBS])
def test_template_bombs_are_refused(source, fragment):
    env, limits = TemplateEnvironment(), TemplateLimits(seconds=2.0)
    start = time.monotonic()

    def render():
        return render_template(compile_template(env, source, "template"), limits, {"messages": []})

    one_line_error(render, fragment)
    assert time.monotonic() - start < 4 * limits.seconds


def test_limits_are_configurable():
    env = TemplateEnvironment()
    template = compile_template(env, "{% for m in messages %}{{ m }}{% endfor %}", "t")
    messages = ["x" * 100] * 50
    assert len(render_template(template, TemplateLimits(), {"messages": messages})) == 5000
    one_line_error(lambda: render_template(template, TemplateLimits(chars=1000), {"messages": messages}),
                   "output would exceed 1000")
    one_line_error(lambda: render_template(template, TemplateLimits(iterations=10), {"messages": messages}),
                   "more than 10 iterations")


@pytest.fixture
def tokenizer_dir(tmp_path):
    path = tmp_path / "tok"
    shutil.copytree(qwen35_tokenizer_dir(), path)
    return path


def test_checkpoint_template_bombs(tokenizer_dir):
    """A bomb in a checkpoint's template loads (compiling runs nothing) and is refused when rendered; so is one among
    tokenizer_config's named templates, under the limits the tokenizer was given."""
    (tokenizer_dir / "chat_template.jinja").write_text("{{ 'x' * 10**10 }}{{ messages }}")
    tok = Tokenizer(tokenizer_dir)
    one_line_error(lambda: tok.apply_chat_template([{"role": "user", "content": "hi"}]), "chat template exceeds")
    (tokenizer_dir / "chat_template.jinja").unlink()
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{% for m in messages %}{{ m }}{% endfor %}"}]
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(tokenizer_dir, TemplateLimits(iterations=2))
    one_line_error(lambda: tok.apply_chat_template([{"role": "user", "content": "hi"}] * 3), "more than 2 iterations")


def test_template_source_errors():
    env = TemplateEnvironment()
    one_line_error(lambda: compile_template(env, "{% for %}", "t"), "t: chat template syntax error on line 1")
    one_line_error(lambda: compile_template(env, "x" * (2 << 20), "t"), "the limit is 1048576")


def test_real_template_renders_long_conversations_within_the_limits(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 200} for i in range(400)]
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "d" * 100,
                                               "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}
             for i in range(50)]
    start = time.monotonic()
    text = tok.apply_chat_template(messages, tools=tools)
    assert len(text) > 400 * 1000 and time.monotonic() - start < 2.0
