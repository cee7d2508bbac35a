"""`qwenrt chat`'s session: the conversation and its settings, the slash commands that change them, multi-line input,
line editing with a history file, and saving / loading a conversation as JSON.

A question joins the conversation only with its whole answer: one stopped with Ctrl-C (or failed) leaves the
conversation as it was, so the next question is asked as if it had never been."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qwenrt import log
from qwenrt.errors import QwenrtError
from qwenrt.files import MIB, read_json
from qwenrt.validation import check_text

# /set NAME VALUE: the sampling settings, each parsed as its flag parses it (--max-tokens, --temperature, ...)
SETTINGS = {"max_tokens": int, "temperature": float, "top_k": int, "top_p": float, "min_p": float,
            "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float, "seed": int}
HISTORY_LINES = 1000  # lines kept in the history file
SAVE_LIMIT = 64 * MIB  # a conversation file /load reads at most
BLOCK = '"""'  # starts and ends a multi-line message

GREETING = (f'commands: /help lists them; {BLOCK} starts a multi-line message; Ctrl-C stops an answer, /exit or '
            "Ctrl-D ends the chat")
HELP = f"""\
/set                   show the settings (also /show)
/set NAME VALUE        a sampling setting: {', '.join(SETTINGS)}
/set system [TEXT]     the system message (without TEXT: none)
/set thinking on|off   think before answering, or not (also /thinking on|off)
/reset                 forget the conversation (the settings stay)
/save FILE             write the conversation and its settings as JSON
/load FILE             continue a saved conversation, with its settings
/help                  this list
/exit, /quit, /bye     end the chat (also Ctrl-D)
{BLOCK}                    starts a multi-line message, {BLOCK} ends it; a line ending in \\ continues on the next
Ctrl-C stops an answer: the question and the partial answer are left out of the conversation"""
STOPPED = "[stopped: the question and the partial answer are left out of the conversation]"


@dataclass
class Session:
    """What the next answer depends on: the settings and the turns so far (user and assistant, oldest first)."""

    sampling: dict  # the sampling options set (flags, /set; None: the checkpoint's default)
    system: str | None = None
    thinking: bool | None = None  # None: the chat template's default
    turns: list[dict] = field(default_factory=list)

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns


# answer(messages, sampling options, thinking) streams the reply to `messages` and returns it as an assistant turn;
# Ctrl-C raises KeyboardInterrupt out of it, a refused request QwenrtError
Answer = Callable[[list[dict], dict, bool | None], dict]
# resolve(sampling options) -> the sampling parameters they give, or QwenrtError (the checks the flags get)
Resolve = Callable[[dict], object]


def ask(session: Session, text: str, answer: Answer) -> None:
    """One exchange. The question and its answer are added only once the answer is whole: an exception out of
    `answer` (KeyboardInterrupt, QwenrtError) leaves the conversation untouched."""
    question = {"role": "user", "content": text}
    reply = answer(session.messages() + [question], session.sampling, session.thinking)
    session.turns += [question, reply]


def read_message(read_line: Callable[[str], str]) -> tuple[str, bool]:
    """The next message, and whether it is a command (a line typed starting with `/`). A message is a line;
    `\"\"\"` up to a line ending in `\"\"\"` (newlines kept); a line ending in a backslash continues on the next."""
    line = read_line(">>> ")
    if line.startswith("/"):
        return line, True
    if line.startswith(BLOCK):
        lines, line = [], line[len(BLOCK):]
        while not line.rstrip().endswith(BLOCK):
            lines.append(line)
            line = read_line("... ")
        lines.append(line.rstrip()[:-len(BLOCK)])
        return "\n".join(lines).strip("\n"), False
    while line.endswith("\\"):
        line = line[:-1] + "\n" + read_line("... ")
    return line, False


def history_path() -> Path:
    """$XDG_CACHE_HOME/qwenrt/chat_history (~/.cache when unset)."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    return Path(root if os.path.isabs(root) else Path.home() / ".cache") / "qwenrt" / "chat_history"


def line_editing() -> Callable[[], None] | None:
    """Arrow keys, editing and the history of earlier sessions on input() (readline), for a terminal on stdin;
    returns what writes the history back (the last HISTORY_LINES lines). A history that cannot be read or written
    is done without."""
    if not sys.stdin.isatty():
        return None
    try:
        import readline
    except ImportError:  # a Python built without it
        return None
    path = history_path()
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(HISTORY_LINES)

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass
    return save


# ---- commands ----

def set_command(session: Session, args: str, resolve: Resolve) -> str:
    """`/set NAME VALUE`: change a setting (refused unless valid, the session unchanged); the note to print."""
    name, _, value = args.strip().partition(" ")
    name, value = name.replace("-", "_"), value.strip()
    if name == "system":
        session.system = value or None
        return f"[system message {'set' if value else 'removed'}]"
    if name == "thinking":
        if value not in ("on", "off"):
            raise QwenrtError("usage: /set thinking on|off")
        session.thinking = value == "on"
        return f"[thinking {value}]"
    kind = SETTINGS.get(name)
    if kind is None:
        raise QwenrtError(f"unknown setting {name!r}; /set takes {', '.join(SETTINGS)}, system, thinking")
    try:
        parsed = kind(value)
    except ValueError:
        raise QwenrtError(f"/set {name} needs {'an integer' if kind is int else 'a number'}, got {value!r}") from None
    options = {**session.sampling, name: parsed}
    resolve(options)
    session.sampling = options
    return f"[{name} {parsed}]"


def describe(session: Session, resolve: Resolve) -> str:
    """The settings the next answer gets (the checkpoint's defaults filled in)."""
    params = resolve(session.sampling)
    values = ", ".join(f"{name} {'none' if getattr(params, name) is None else getattr(params, name)}"
                       for name in SETTINGS)
    thinking = {None: "the template's default", True: "on", False: "off"}[session.thinking]
    system = "none" if session.system is None else json.dumps(session.system, ensure_ascii=False)
    return f"{values}\nthinking: {thinking}\nsystem message: {system}"


def save(session: Session, path: Path) -> None:
    """The conversation (OpenAI-style messages, the system message first) and its settings, as JSON."""
    body = {"messages": session.messages(),
            "settings": {**{name: session.sampling.get(name) for name in SETTINGS}, "thinking": session.thinking}}
    try:
        path.write_text(json.dumps(body, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        raise QwenrtError(f"cannot write {path}: {getattr(e, 'strerror', None) or e}") from None


def load(session: Session, path: Path, resolve: Resolve) -> None:
    """Replace the session's conversation and settings with a file's that /save wrote (a setting the file lacks
    stays), every value checked as the flags are. On QwenrtError (naming the first thing wrong) nothing changed."""
    body = read_json(path, SAVE_LIMIT, "conversation file")
    unknown = set(body) - {"messages", "settings"}
    if unknown:
        raise QwenrtError(f"{path}: unknown field {sorted(unknown)[0]!r} (a conversation file has messages and "
                          "settings)")
    system, turns = _messages(body.get("messages", []), path)
    settings = body.get("settings", {})
    if not isinstance(settings, dict):
        raise QwenrtError(f"{path}: settings must be an object, got {type(settings).__name__}")
    sampling, thinking = dict(session.sampling), session.thinking
    for name, value in settings.items():
        if name == "thinking":
            if value is not None and not isinstance(value, bool):
                raise QwenrtError(f"{path}: settings.thinking must be true, false or null, got {value!r:.40}")
            thinking = value
        elif name in SETTINGS:
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or
                                      (SETTINGS[name] is int and not isinstance(value, int))):
                kind = "an integer" if SETTINGS[name] is int else "a number"
                raise QwenrtError(f"{path}: settings.{name} must be {kind} or null, got {value!r:.40}")
            sampling[name] = value
        else:
            raise QwenrtError(f"{path}: unknown setting {name!r:.40}")
    try:
        resolve(sampling)
    except QwenrtError as e:
        raise QwenrtError(f"{path}: settings: {e}") from None
    session.sampling, session.system, session.thinking, session.turns = sampling, system, thinking, turns


def _messages(messages, path: Path) -> tuple[str | None, list[dict]]:
    """(system message, turns) of a saved conversation: an optional system message, then user and assistant turns
    in turn, ending with an answer."""
    if not isinstance(messages, list):
        raise QwenrtError(f"{path}: messages must be a list, got {type(messages).__name__}")
    system, turns = None, []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise QwenrtError(f"{path}: messages[{i}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        expected = "system" if i == 0 and role == "system" else ("user", "assistant")[len(turns) % 2]
        if role != expected:
            raise QwenrtError(f"{path}: messages[{i}] must be a {expected} turn, got role {role!r:.40}")
        extra = set(message) - {"role", "content"} - ({"reasoning_content"} if role == "assistant" else set())
        if extra:
            raise QwenrtError(f"{path}: messages[{i}]: unknown field {sorted(extra)[0]!r:.40}")
        content = check_text(message.get("content"), f"{path}: messages[{i}].content")
        if role == "system":
            system = content or None
            continue
        turn = {"role": role, "content": content}
        if "reasoning_content" in message:
            turn["reasoning_content"] = check_text(message["reasoning_content"],
                                                   f"{path}: messages[{i}].reasoning_content")
        turns.append(turn)
    if len(turns) % 2:
        raise QwenrtError(f"{path}: the conversation ends with a question (messages[{len(messages) - 1}]); it must "
                          "end with an answer")
    return system, turns


def command(session: Session, line: str, resolve: Resolve) -> bool:
    """Run a slash command, printing its note or its error (the session goes on); False for /exit."""
    name, _, args = line.strip().partition(" ")
    args = args.strip()
    try:
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name == "/help":
            print(HELP, file=sys.stderr)
        elif name == "/reset":
            session.turns = []
            print("[conversation reset]", file=sys.stderr)
        elif name == "/show" or (name == "/set" and not args):
            print(describe(session, resolve), file=sys.stderr)
        elif name == "/set":
            print(set_command(session, args, resolve), file=sys.stderr)
        elif name == "/thinking":
            print(set_command(session, f"thinking {args}", resolve), file=sys.stderr)
        elif name in ("/save", "/load") and not args:
            print(f"usage: {name} FILE", file=sys.stderr)
        elif name == "/save":
            save(session, Path(args).expanduser())
            print(f"[saved {len(session.turns) // 2} exchanges to {args}]", file=sys.stderr)
        elif name == "/load":
            load(session, Path(args).expanduser(), resolve)
            print(f"[loaded {len(session.turns) // 2} exchanges from {args}]", file=sys.stderr)
        else:
            print(f"unknown command {name}; /help lists the commands", file=sys.stderr)
    except QwenrtError as e:
        print(f"error: {e}", file=sys.stderr)
    return True


def run(session: Session, answer: Answer, resolve: Resolve, read_line: Callable[[str], str] = input) -> None:
    """The session on the terminal until /exit or end of input."""
    save_history = line_editing() if read_line is input else None
    log.info(GREETING)
    try:
        while True:
            try:
                text, is_command = read_message(read_line)
            except EOFError:
                print(file=sys.stderr)
                return
            except KeyboardInterrupt:  # at the prompt: the line is dropped
                print(file=sys.stderr)
                continue
            if not text.strip():
                continue
            if is_command:
                if not command(session, text, resolve):
                    return
                continue
            try:
                ask(session, text, answer)
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                print(STOPPED, file=sys.stderr)
            except QwenrtError as e:  # e.g. the conversation outgrew the context: the session goes on
                print(f"\nerror: {e}", file=sys.stderr)
    finally:
        if save_history is not None:
            save_history()
