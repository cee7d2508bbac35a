"""Generation on a tiny model with the real Qwen3.5 vocabulary: against transformers, and its own invariants."""

import pytest
import torch

import qwenrt
from qwenrt import QwenrtError
from tests.hostile import one_line_error

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three prime numbers."}]


def reference_greedy(ref, ids, n, **options):
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=248044,
                           eos_token_id=[248046, 248044], **options)
    return out[0, len(ids):].tolist()


def test_greedy_chat_matches_transformers(chat_model):
    model, tok, ref = chat_model
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, enable_thinking=False)
    completion = qwenrt.complete(model, tok, MESSAGES, max_tokens=24, enable_thinking=False)
    assert completion.tokens == reference_greedy(ref, tok.encode(prompt), 24)
    assert completion.finish_reason == "length" and completion.prompt_tokens == len(tok.encode(prompt))
    assert completion.text == tok.decode(completion.tokens)
    assert completion.reasoning is None and completion.content == completion.text


def test_repetition_penalty_matches_transformers(chat_model):
    model, tok, ref = chat_model
    ids = tok.encode("def fibonacci(n):")
    ours = qwenrt.complete(model, tok, ids, max_tokens=20, repetition_penalty=1.3)
    assert ours.tokens == reference_greedy(ref, ids, 20, repetition_penalty=1.3)


def test_stream_equals_generate(chat_model):
    model, tok, _ = chat_model
    events = list(qwenrt.stream_generate(model, tok, "Once upon a time", max_tokens=30))
    assert all(e.finish_reason is None for e in events[:-1]) and events[-1].finish_reason == "length"
    assert events[-1].generation_tokens == 30 and events[-1].prompt_tokens == len(tok.encode("Once upon a time"))
    assert all("\ufffd" not in e.text for e in events)
    assert "".join(e.text for e in events) == qwenrt.generate(model, tok, "Once upon a time", max_tokens=30)


def test_batched_equals_one_by_one(chat_model):
    model, tok, _ = chat_model
    prompts = ["Hi", MESSAGES, "A much longer prompt about the weather in Paris, " * 8, tok.encode("x = 1 +")]
    batch = qwenrt.batch_generate(model, tok, prompts, max_tokens=16)
    for prompt, result in zip(prompts, batch):
        assert result.tokens == qwenrt.complete(model, tok, prompt, max_tokens=16).tokens


def test_batch_rows_finish_independently(chat_model):
    model, tok, _ = chat_model
    free = qwenrt.complete(model, tok, "Hello there", max_tokens=12)
    stop_id = free.tokens[4]
    first = free.tokens.index(stop_id)
    results = qwenrt.batch_generate(model, tok, ["Hello there", "Other words"], max_tokens=12, stop_token_ids=[stop_id])
    assert results[0].tokens == free.tokens[:first] and results[0].finish_reason == "stop"
    alone = qwenrt.complete(model, tok, "Other words", max_tokens=12, stop_token_ids=[stop_id])
    assert results[1].tokens == alone.tokens and results[1].finish_reason == alone.finish_reason


def test_chunked_prefill_gives_same_tokens(chat_model):
    model, tok, _ = chat_model
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    whole = qwenrt.complete(model, tok, prompt, max_tokens=10, prefill_chunk=4096)
    chunked = qwenrt.complete(model, tok, prompt, max_tokens=10, prefill_chunk=7)
    assert chunked.tokens == whole.tokens


def test_seeded_sampling_is_reproducible(chat_model):
    model, tok, _ = chat_model
    options = dict(max_tokens=20, temperature=1.0, top_k=50, top_p=0.95)
    a = qwenrt.complete(model, tok, "Tell me a story", seed=7, **options)
    b = qwenrt.complete(model, tok, "Tell me a story", seed=7, **options)
    c = qwenrt.complete(model, tok, "Tell me a story", seed=8, **options)
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_stop_strings_cut_exactly(chat_model):
    model, tok, _ = chat_model
    free = qwenrt.generate(model, tok, "Count:", max_tokens=40)
    stop = free[len(free) // 2: len(free) // 2 + 3]
    assert stop.strip()
    text = qwenrt.generate(model, tok, "Count:", max_tokens=40, stop=[stop])
    assert text == free[: free.index(stop)]
    streamed = list(qwenrt.stream_generate(model, tok, "Count:", max_tokens=40, stop=stop))
    assert "".join(e.text for e in streamed) == text and streamed[-1].finish_reason == "stop"


def test_context_limit_and_bad_prompts(chat_model):
    model, tok, _ = chat_model
    with pytest.raises(QwenrtError, match="context limit is 10"):
        qwenrt.generate(model, tok, "one two three four five six seven eight nine ten eleven", max_context=10)
    with pytest.raises(QwenrtError, match="empty"):
        qwenrt.generate(model, tok, "")
    with pytest.raises(QwenrtError, match="outside the vocabulary"):
        qwenrt.generate(model, tok, [1, 2, 10**9])
    with pytest.raises(QwenrtError, match="outside the vocabulary"):  # checked before anything decodes them
        qwenrt.generate(model, tok, [-5, 3])
    with pytest.raises(QwenrtError, match="top_p"):
        qwenrt.generate(model, tok, "hi", top_p=2.0)
    with pytest.raises(QwenrtError, match="unknown generation option"):
        qwenrt.generate(model, tok, "hi", temprature=0.5)


def test_length_stops_at_context_limit(chat_model):
    model, tok, _ = chat_model
    ids = tok.encode("a b c")
    result = qwenrt.complete(model, tok, ids, max_tokens=100, max_context=len(ids) + 5)
    assert result.finish_reason == "length" and len(result.tokens) == 5


def test_bad_arguments_to_the_api_are_one_line(chat_model):
    model, tok, _ = chat_model
    one_line_error(lambda: qwenrt.batch_generate(model, tok, []), "no prompts given")  # was [] silently
    one_line_error(lambda: qwenrt.batch_generate(model, tok, "hi"), "prompts must be a list, got str")  # was 2 prompts
    one_line_error(lambda: qwenrt.batch_generate(model, tok, None), "prompts must be a list, got NoneType")
    one_line_error(lambda: qwenrt.generate(model, tok, torch.tensor([[1, 2], [3, 4]])), "must be one row, got shape [2, 2]")
    one_line_error(lambda: qwenrt.generate(model, tok, "hi", params=5), "params must be a SamplingParams, got int")
    one_line_error(lambda: qwenrt.generate(model, 5, "hi"), "tokenizer must be the Tokenizer", "got int")
    one_line_error(lambda: qwenrt.generate(5, tok, "hi"), "model must be the model qwenrt.load returned", "got int")
    one_line_error(lambda: qwenrt.generate(model, tok, MESSAGES, enable_thinking="no"),
                   "enable_thinking must be True or False")  # "no" is truthy: it switched thinking on
    one_line_error(lambda: qwenrt.generate(model, tok, "hi", enable_thinking="no"),
                   "enable_thinking must be True or False")  # was accepted (a raw prompt renders no template)
    one_line_error(lambda: list(qwenrt.stream_generate(model, tok, "hi", on_prefill=5)), "on_prefill must be a function")
    one_line_error(lambda: qwenrt.generate(model, tok, "hi", temprature=0.5, max_tokenz=2),
                   "unknown generation option(s): max_tokenz, temprature")
    one_line_error(lambda: qwenrt.generate(model, tok, "hi", stop=5), "stop must be a string or a list of strings")


def test_load_gives_the_tokenizer_the_models_vocabulary():
    """qwenrt-tiny's embedding has 576 rows for 548 tokens; the padded ids (~7e-4 of the probability at temperature
    1) decode to nothing rather than failing a generation or its round trip."""
    model, tok = qwenrt.load()
    assert tok.vocab_size < model.config.text.vocab_size == tok.id_limit
    padded = tok.vocab_size + 3
    assert tok.decode([padded]) == "" and tok.decode([*tok.encode("Hi"), padded]) == "Hi"
    one_line_error(lambda: tok.decode([tok.id_limit]), "outside the vocabulary")
