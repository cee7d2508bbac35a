"""The chat-template sandbox: transformers' jinja2 environment (immutable sandbox, its globals and filters), with
limits on render time, on the size of every value a template builds and of all it emits, and on integer growth.

A template comes with a downloaded checkpoint: untrusted code. The sandbox keeps it from Python internals; the
limits keep it from hanging or exhausting memory. Before compiling, the template's syntax tree is rewritten so that
every loop iterates through a guard (time, iteration count), every emitted value and every built value (`~`,
filters, calls) is measured; operators, calls and filters whose result can outgrow their inputs by an argument
(`*`, `**`, `%`, `center`, `indent`, `replace`, `join`, `tojson`, ...) are checked before they run.
"""

from __future__ import annotations

import contextvars
import json
import re
import string
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum
from jinja2.visitor import NodeTransformer

from qwenrt.errors import QwenrtError

SOURCE_LIMIT = 1 << 20  # characters of template source (Qwen3.5's is ~7K)
ARG_LIMIT = 1 << 20  # integer arguments of calls and filters (widths, counts)


@dataclass(frozen=True)
class TemplateLimits:
    """What one render may take. The defaults leave a 262K-token prompt far inside them."""

    seconds: float = 5.0  # wall time of a render
    chars: int = 1 << 23  # size of any value the template builds, and of everything it emits in all
    iterations: int = 1 << 20  # loop iterations, all loops together
    int_bits: int = 4096  # integers the template computes


class LimitExceeded(jinja2.exceptions.SecurityError):
    """A template went past its TemplateLimits."""


class _Budget:
    def __init__(self, limits: TemplateLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.emitted = self.iterations = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise LimitExceeded(f"rendering took longer than {self.limits.seconds:g} s")


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("qwenrt_template_budget", default=None)


def _limits() -> TemplateLimits:
    budget = _budget.get()
    return budget.limits if budget is not None else TemplateLimits()


def _tick() -> None:
    budget = _budget.get()
    if budget is not None:
        budget.tick()


def size_within(value: Any, limit: int) -> int:
    """A bounded measure of a value (characters of strings, one per other leaf and container entry, shared parts
    counted each time they appear, as serializing them would); raises LimitExceeded past `limit`."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 1 + len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += 1 + 2 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, jinja2.utils.Namespace):
            continue
        else:
            total += 1
        if total > limit:
            raise LimitExceeded(f"a value would exceed {limit} characters")
    return total


def _check_value(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _limits().int_bits:
        raise LimitExceeded(f"an integer would exceed {_limits().int_bits} bits")
    size_within(value, _limits().chars)
    return value


def _check_int_args(args, kwargs) -> None:
    """An integer argument is a width, a count or a repetition: past ARG_LIMIT it can only blow up."""
    limit = min(_limits().chars, ARG_LIMIT)
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > limit:
            raise LimitExceeded(f"argument {arg} exceeds {limit}")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?")


def _check_percent_format(fmt: str, args: Any) -> None:
    """`fmt % args`: widths and precisions (given or taken from `*`) within the size limit."""
    limit = _limits().chars
    values = list(args) if isinstance(args, tuple) else [args]
    for width, precision in _PERCENT_SPEC.findall(fmt):
        for part in (width, precision):
            if part == "*":
                star = next((v for v in values if isinstance(v, int)), 0)
                if abs(star) > limit:
                    raise LimitExceeded(f"format width {star} exceeds {limit}")
            elif part and int(part) > limit:
                raise LimitExceeded(f"format width {part} exceeds {limit}")


def _check_brace_format(fmt: str) -> None:
    """`fmt.format(...)`: literal widths within the limit and no nested (argument-given) widths."""
    limit = _limits().chars
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError as e:
        raise LimitExceeded(f"bad format string ({e})") from None
    for _, _, spec, _ in fields:
        if spec and "{" in spec:
            raise LimitExceeded("nested format fields are not allowed")
        if spec and any(int(n) > limit for n in re.findall(r"\d+", spec)):
            raise LimitExceeded(f"a format width exceeds {limit}")


def _check_replace(text: str, old: str, new: str, count: int = -1) -> None:
    hits = len(text) + 1 if old == "" else text.count(old)
    hits = hits if count is None or count < 0 else min(hits, count)
    if len(text) + hits * (len(new) - len(old)) > _limits().chars:
        raise LimitExceeded(f"replace would exceed {_limits().chars} characters")


def _check_indent(text: str, width: Any = 4, *_: Any, **__: Any) -> None:
    pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    if len(text) + pad * (text.count("\n") + 1) > _limits().chars:
        raise LimitExceeded(f"indent would exceed {_limits().chars} characters")


def _check_json_options(indent: Any = None, separators: Any = None) -> None:
    if isinstance(indent, str) and len(indent) > 16 or isinstance(indent, int) and indent > 16:
        raise LimitExceeded(f"tojson indent {indent!r} is over 16")
    if separators is not None and size_within(separators, 32) > 32:
        raise LimitExceeded("tojson separators are too long")


def _precheck_filter(name: str, args: tuple, kwargs: dict) -> None:
    """Checks before a filter runs, for the filters whose output can outgrow their input by an argument."""
    _check_int_args(args, kwargs)
    value = args[0] if args else None
    if name in ("join", "tojson", "string", "pprint", "list", "sum", "unique", "sort", "batch", "slice"):
        size_within(value, _limits().chars)  # shared parts of the input count every time they appear
    if name == "tojson":
        _check_json_options(kwargs.get("indent", args[2] if len(args) > 2 else None), kwargs.get("separators"))
    elif name == "replace" and isinstance(value, str) and len(args) >= 3:
        _check_replace(value, str(args[1]), str(args[2]), args[3] if len(args) > 3 else kwargs.get("count", -1))
    elif name == "indent" and isinstance(value, str):
        _check_indent(value, *args[1:2], **{k: v for k, v in kwargs.items() if k == "width"})
    elif name == "format" and isinstance(value, str):
        _check_percent_format(value, tuple(args[1:]) or kwargs)


def _guard_filter(name: str, func):
    """`func` with the checks before and a size check of the result; jinja's pass_* markers kept."""
    offset = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    def guarded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        _precheck_filter(name, args[offset:], kwargs)
        return _check_value(func(*args, **kwargs))

    guarded.__dict__.update(getattr(func, "__dict__", {}))
    guarded.__name__ = getattr(func, "__name__", name)
    return guarded


_STR_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "format", "format_map"}


def _precheck_call(func: Any, args: tuple, kwargs: dict) -> None:
    """Checks before a call: integer arguments, and the str methods whose output an argument can blow up."""
    _check_int_args(args, kwargs)
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", "")
    if name in ("format", "format_map") and isinstance(getattr(func, "__wrapped__", None), type("".format)):
        _check_brace_format(func.__wrapped__.__self__)
        return
    if not isinstance(owner, str) or name not in _STR_METHODS:
        return
    if name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int) and tab * owner.count("\t") > _limits().chars:
            raise LimitExceeded(f"expandtabs would exceed {_limits().chars} characters")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_replace(owner, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1))
    elif name == "join" and args:
        size_within(args[0], _limits().chars)


class _GuardInserter(NodeTransformer):
    """Rewrites a parsed template so loops, emitted values and built values go through the environment's guards."""

    @staticmethod
    def _wrap(guard: str, node: nodes.Expr) -> nodes.Expr:
        return nodes.Call(nodes.EnvironmentAttribute(guard), [node], [], None, None, lineno=node.lineno)

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = self._wrap("guard_loop", node.iter)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        node = self.generic_visit(node)
        node.nodes = [self._wrap("guard_emit", n) for n in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Expr:
        return self._wrap("guard_value", self.generic_visit(node))



class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; it renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, which could reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


class _TemplateDict:
    """`dict()` for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Not jinja's tojson: that one HTML-escapes `<`, `>`, `&` and `'`.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (jinja's names)
    if not all(isinstance(v, int) and 0 <= v <= 1000 for v in (n, min, max)):
        raise LimitExceeded("lipsum arguments must be integers in [0, 1000]")
    return generate_lorem_ipsum(n, html, min, max)


class TemplateEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment plus the guards (see the module docstring)."""

    intercepted_binops = frozenset({"*", "**", "%", "+", "//"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                            namespace=_TemplateNamespace, lipsum=_lipsum)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _tick()
        limits = _limits()
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right))
        if operator == "**" and ints and right > 0 and max(left.bit_length(), 1) * right > limits.int_bits:
            raise LimitExceeded(f"{left} ** {right} would exceed {limits.int_bits} bits")
        if operator == "*" and ints and left.bit_length() + right.bit_length() > limits.int_bits:
            raise LimitExceeded(f"a product would exceed {limits.int_bits} bits")
        if operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > limits.chars:
                raise LimitExceeded(f"repeating a sequence {times} times would exceed {limits.chars} items")
        if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            if len(left) + len(right) > limits.chars:
                raise LimitExceeded(f"a concatenation would exceed {limits.chars} items")
        if operator == "%" and isinstance(left, str):
            _check_percent_format(left, right)
        return _check_value(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        _tick()
        _precheck_call(__obj, args, kwargs)
        return _check_value(super().call(__context, __obj, *args, **kwargs))

    def guard_loop(self, iterable: Any):
        budget = _budget.get()
        for item in iterable:
            if budget is not None:
                budget.iterations += 1
                if budget.iterations > budget.limits.iterations:
                    raise LimitExceeded(f"loops ran more than {budget.limits.iterations} iterations")
                budget.tick()
            yield item

    def guard_emit(self, value: Any) -> Any:
        budget = _budget.get()
        if budget is not None:
            budget.emitted += size_within(value, budget.limits.chars)
            if budget.emitted > budget.limits.chars:
                raise LimitExceeded(f"the output would exceed {budget.limits.chars} characters")
        return value

    def guard_value(self, value: Any) -> Any:
        _tick()
        return _check_value(value)


def compile_template(env: TemplateEnvironment, source: str, where) -> jinja2.Template:
    """Parse, guard and compile a chat template; one QwenrtError for anything wrong with it."""
    if len(source) > SOURCE_LIMIT:
        raise QwenrtError(f"{where}: chat template is {len(source)} characters; the limit is {SOURCE_LIMIT}")
    try:
        return env.from_string(_GuardInserter().visit(env.parse(source)))
    except jinja2.TemplateSyntaxError as e:
        raise QwenrtError(f"{where}: chat template syntax error on line {e.lineno}: {e.message}") from None
    except RecursionError:
        raise QwenrtError(f"{where}: chat template is nested too deeply") from None
    except LimitExceeded as e:
        raise QwenrtError(f"{where}: chat template exceeds its limits: {e}") from None


def render_template(template: jinja2.Template, limits: TemplateLimits, variables: dict) -> str:
    """Render within `limits`; any failure of the (untrusted) template is one QwenrtError."""
    token = _budget.set(_Budget(limits))
    try:
        return "".join(template.generate(**variables))
    except LimitExceeded as e:
        raise QwenrtError(f"chat template exceeds its limits: {e}") from None
    except RecursionError:
        raise QwenrtError("chat template: recursion too deep") from None
    except MemoryError:
        raise QwenrtError("chat template: out of memory") from None
    except Exception as e:  # noqa: BLE001 - untrusted code: whatever it raises is the template's failure
        raise QwenrtError(f"chat template: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    finally:
        _budget.reset(token)
