"""`qwenrt chat`'s session without a model: what a question stopped with Ctrl-C leaves behind, multi-line input,
/set's checks, /save and /load (hostile files included), the history file. tests/test_cli.py drives the real
thing."""

import json

import pytest

from qwenrt.chat_session import (HISTORY_LINES, SETTINGS, STOPPED, Session, history_path, line_editing, load,
                                 read_message, run, save, set_command)
from qwenrt.console import sampling_params
from qwenrt.errors import QwenrtError
from qwenrt.sampling import check_generates


def resolve(options: dict):
    """As `qwenrt chat` checks settings (a checkpoint without generation defaults)."""
    params = sampling_params(options, None)
    check_generates(params)
    return params


def lines(*given: str):
    """A read_line that answers with `given`, then end of input."""
    pending = list(given)

    def read_line(prompt: str) -> str:
        if not pending:
            raise EOFError
        line = pending.pop(0)
        if isinstance(line, BaseException):
            raise line
        return line
    return read_line


class Answers:
    """An answer function that records the messages each answer was asked for; `stop_first` makes the first answer
    end in Ctrl-C after part of it was written."""

    def __init__(self, stop_first: bool = False):
        self.asked, self.stop_first = [], stop_first

    def __call__(self, messages, sampling, thinking):
        self.asked.append((messages, dict(sampling), thinking))
        if self.stop_first and len(self.asked) == 1:
            print("a partial ans", end="")
            raise KeyboardInterrupt
        return {"role": "assistant", "content": f"answer {len(self.asked)}"}


def test_a_question_stopped_with_ctrl_c_leaves_the_conversation_as_it_was(capsys):
    """It stayed in: the next question was asked after the stopped one and its partial answer (296 tokens, a garbled
    answer). Now the next question is asked exactly as in a fresh conversation."""
    session = Session({"max_tokens": 8}, system="Be brief.")
    answers = Answers(stop_first=True)
    run(session, answers, resolve, lines("Tell me everything", "What is 2+2?"))
    fresh = Answers()
    run(Session({"max_tokens": 8}, system="Be brief."), fresh, resolve, lines("What is 2+2?"))
    assert answers.asked[1] == fresh.asked[0]
    assert session.turns == [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "answer 2"}]
    assert STOPPED in capsys.readouterr().err


def test_a_refused_question_leaves_the_conversation_as_it_was(capsys):
    def refuse(messages, sampling, thinking):
        raise QwenrtError("the conversation is over the context limit")

    session = Session({})
    run(session, refuse, resolve, lines("Hi"))
    assert session.turns == [] and "error: the conversation is over the context limit" in capsys.readouterr().err


def test_multi_line_messages():
    assert read_message(lines('"""', "one", "", "two", '"""')) == ("one\n\ntwo", False)
    assert read_message(lines('"""one', 'two"""')) == ("one\ntwo", False)
    assert read_message(lines('"""just one"""')) == ("just one", False)
    assert read_message(lines("one \\", "two\\", "three")) == ("one \ntwo\nthree", False)
    assert read_message(lines('"""', "/not a command", '"""')) == ("/not a command", False)
    assert read_message(lines("/set system ends in \\")) == ("/set system ends in \\", True)
    with pytest.raises(EOFError):  # end of input inside a block ends the chat
        read_message(lines('"""', "one"))


def test_set_changes_the_next_answer_and_refuses_what_the_flags_refuse(capsys):
    session = Session({"max_tokens": 512, "temperature": None})
    answers = Answers()
    run(session, answers, resolve, lines("/set temperature 0.7", "/set max-tokens 20", "/set system Be brief.",
                                         "/set thinking off", "Hi", "/set", "/show"))
    messages, sampling, thinking = answers.asked[0]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert (sampling["temperature"], sampling["max_tokens"], thinking) == (0.7, 20, False)
    err = capsys.readouterr().err
    assert err.count("max_tokens 20, temperature 0.7, top_k 0") == 2 and 'system message: "Be brief."' in err
    refused = [("top_p 3", "top_p must be in (0, 1], got 3.0"), ("max_tokens 0", "max_tokens must be an integer >= 1"),
               ("max_tokens 2.5", "/set max_tokens needs an integer, got '2.5'"),
               ("temperature nan", "temperature must be a finite number"), ("temperature", "needs a number, got ''"),
               ("temperature -1", "temperature must be >= 0"), ("top_k many", "needs an integer"),
               ("thinking maybe", "usage: /set thinking on|off"), ("colour blue", "unknown setting 'colour'")]
    for args, message in refused:
        with pytest.raises(QwenrtError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            set_command(session, args, resolve)
    assert (session.sampling["temperature"], session.sampling["max_tokens"], session.thinking) == (0.7, 20, False)
    run(session, Answers(), resolve, lines("/set top_p 3"))  # one line, and the chat goes on
    assert capsys.readouterr().err.splitlines()[1:] == ["error: top_p must be in (0, 1], got 3.0", ""]


def test_save_then_load_restores_the_conversation_and_its_settings(tmp_path):
    flags = dict.fromkeys(SETTINGS) | {"stop": ["END"]}  # as `qwenrt chat` gets them: every option, None unset
    session = Session(flags | {"max_tokens": 512, "temperature": 0.7}, system="Be brief.", thinking=True)
    session.turns = [{"role": "user", "content": "Hi ünïcode\n"},
                     {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."}]
    save(session, tmp_path / "chat.json")
    saved = json.loads((tmp_path / "chat.json").read_text())
    assert saved["messages"] == session.messages() and saved["settings"]["temperature"] == 0.7
    other = Session(flags | {"max_tokens": 10, "top_k": 5})
    load(other, tmp_path / "chat.json", resolve)
    assert other == session


def test_a_bad_conversation_file_is_one_line_and_keeps_the_conversation(tmp_path):
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    cases = [
        ("[]", "expected a JSON object"),
        ("{", "is not valid JSON"),
        ('{"messages": [{"role": "user", "content": "Hi"}]}', "ends with a question"),
        ('{"messages": [{"role": "assistant", "content": "Hi"}]}',
         "messages[0] must be a user turn, got role 'assistant'"),
        ('{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": ""}]}',
         "messages[0].content must be a string, got int"),
        ('{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": ""}]}',
         "not valid Unicode"),
        ('{"messages": [{"role": "user", "content": "Hi", "tool_calls": []}, {"role": "assistant", "content": ""}]}',
         "unknown field 'tool_calls'"),
        ('{"messages": [1]}', "messages[0] must be an object, got int"),
        ('{"messages": {}}', "messages must be a list"),
        ('{"messages": [], "settings": {"temperature": -1}}', "settings: temperature must be >= 0"),
        ('{"messages": [], "settings": {"max_tokens": 2.5}}', "settings.max_tokens must be an integer or null"),
        ('{"messages": [], "settings": {"top_p": "1"}}', "settings.top_p must be a number or null"),
        ('{"messages": [], "settings": {"thinking": "yes"}}', "settings.thinking must be true, false or null"),
        ('{"messages": [], "settings": {"grammar": "start: x"}}', "unknown setting 'grammar'"),
        ('{"messages": [], "settings": []}', "settings must be an object"),
        ('{"messages": [], "tools": []}', "unknown field 'tools'"),
        ('{"messages": [], "settings": {"temperature": NaN}}', "is not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "is not valid JSON"),
        (b"\xff\xfe", "not UTF-8"),
    ]
    for i, (text, message) in enumerate(cases):
        path = tmp_path / f"bad{i}.json"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        session = Session({"max_tokens": 5}, "Be brief.", None, list(turns))
        with pytest.raises(QwenrtError, match=message.replace("(", r"\(").replace("[", r"\[")) as e:
            load(session, path, resolve)
        assert "\n" not in str(e.value)
        assert session == Session({"max_tokens": 5}, "Be brief.", None, turns)
    for path, message in [(tmp_path / "missing.json", "conversation file not found"), (tmp_path, "is a directory")]:
        with pytest.raises(QwenrtError, match=message):
            load(Session({}), path, resolve)
    with pytest.raises(QwenrtError, match="cannot write"):
        save(Session({}), tmp_path / "no" / "such" / "dir.json")


def test_history_file_is_read_written_and_bounded(tmp_path, monkeypatch):
    readline = pytest.importorskip("readline")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert history_path() == tmp_path / "qwenrt" / "chat_history"
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert line_editing() is None  # piped input: no line editing, no history
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    history_path().parent.mkdir()
    history_path().write_text("".join(f"line {i}\n" for i in range(HISTORY_LINES + 500)))
    readline.clear_history()
    try:
        save_history = line_editing()
        assert readline.get_history_item(readline.get_current_history_length()) == f"line {HISTORY_LINES + 499}"
        readline.add_history("/set temperature 0.7")
        save_history()
    finally:
        readline.clear_history()
    kept = history_path().read_text().splitlines()
    assert len(kept) == HISTORY_LINES and kept[-1] == "/set temperature 0.7"
