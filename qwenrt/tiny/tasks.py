"""What the built-in model knows: generated, seeded chat conversations in the `messages` format.

Families: addition / subtraction of integers up to 999 (digit-by-digit working inside <think> when thinking is
on, opening the reply when off); tool use (a `calculator` for multiplication and division of larger numbers, and
`get_capital` over a small fixed table), answered from the <tool_response>; sorting a few numbers; repeating
words back; and a short polite refusal for anything else. A fixed tenth of operand pairs and of countries never
appears in training (`held_out`): the quality test draws only from those. Two-digit multiplication with working
(`mul_reasoning`, `multiplication_conversations`) is not one of them: a new task to fine-tune the model on.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass

REFUSAL = ("Sorry, I can't help with that. I can add and subtract numbers, sort numbers, and use my calculator and "
           "capital tools.")
REFUSAL_REASONING = "This request is outside what I can do."
NO_TOOL_REASONING = "No tool to look up capitals is on offer."

CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Multiply or divide two whole numbers exactly.",
    "parameters": {"type": "object", "properties": {
        "expression": {"type": "string", "description": "two numbers joined by * or /, e.g. 1234 * 56"}},
        "required": ["expression"]}}}
CAPITAL_TOOL = {"type": "function", "function": {
    "name": "get_capital", "description": "Look up the capital city of a country.",
    "parameters": {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}}}
TOOLS = [CALCULATOR_TOOL, CAPITAL_TOOL]

# the lookup tool's table
CAPITALS = {
    "Argentina": "Buenos Aires", "Australia": "Canberra", "Austria": "Vienna", "Belgium": "Brussels",
    "Brazil": "Brasilia", "Canada": "Ottawa", "Chile": "Santiago", "China": "Beijing", "Colombia": "Bogota",
    "Croatia": "Zagreb", "Cuba": "Havana", "Denmark": "Copenhagen", "Egypt": "Cairo", "Estonia": "Tallinn",
    "Ethiopia": "Addis Ababa", "Finland": "Helsinki", "France": "Paris", "Germany": "Berlin", "Ghana": "Accra",
    "Greece": "Athens", "Hungary": "Budapest", "Iceland": "Reykjavik", "India": "New Delhi", "Indonesia": "Jakarta",
    "Ireland": "Dublin", "Italy": "Rome", "Japan": "Tokyo", "Kenya": "Nairobi", "Mexico": "Mexico City",
    "Morocco": "Rabat", "Nepal": "Kathmandu", "Netherlands": "Amsterdam", "New Zealand": "Wellington",
    "Nigeria": "Abuja", "Norway": "Oslo", "Peru": "Lima", "Poland": "Warsaw", "Portugal": "Lisbon",
    "Romania": "Bucharest", "Senegal": "Dakar", "South Korea": "Seoul", "Spain": "Madrid", "Sweden": "Stockholm",
    "Switzerland": "Bern", "Thailand": "Bangkok", "Turkey": "Ankara", "Uganda": "Kampala", "Vietnam": "Hanoi",
}

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are qwenrt-tiny, a small assistant.", "Answer briefly."]

ADD_PROMPTS = ["What is {a} + {b}?", "What's {a} plus {b}?", "Compute {a} + {b}.", "Calculate {a} + {b}",
               "{a} + {b} = ?", "{a} + {b}", "How much is {a} plus {b}?", "Add {a} and {b}.",
               "What is the sum of {a} and {b}?", "what is {a}+{b}"]
SUB_PROMPTS = ["What is {a} - {b}?", "What's {a} minus {b}?", "Compute {a} - {b}.", "Calculate {a} - {b}",
               "{a} - {b} = ?", "{a} - {b}", "How much is {a} minus {b}?", "Subtract {b} from {a}.",
               "What is {a} take away {b}?", "what is {a}-{b}"]
MUL_PROMPTS = ["What is {a} * {b}?", "What is {a} × {b}?", "Multiply {a} by {b}.", "What's {a} times {b}?",
               "Calculate {a} * {b}", "{a} x {b} = ?", "What is the product of {a} and {b}?"]
DIV_PROMPTS = ["What is {a} / {b}?", "What is {a} divided by {b}?", "Divide {a} by {b}.", "Compute {a} / {b}.",
               "What is {a} ÷ {b}?", "{a} / {b} = ?", "How much is {a} divided by {b}?"]
CAPITAL_PROMPTS = ["What is the capital of {c}?", "What's the capital city of {c}?", "Which city is the capital "
                   "of {c}?", "Capital of {c}?", "Tell me the capital of {c}.", "What is {c}'s capital?"]
SORT_PROMPTS = ["Sort these numbers: {xs}", "Sort {xs} in ascending order.", "Put {xs} in order from smallest "
                "to largest.", "Order these numbers from low to high: {xs}"]
SORT_DOWN_PROMPTS = ["Sort {xs} from largest to smallest.", "Sort these numbers in descending order: {xs}",
                     "Order these numbers from high to low: {xs}"]

_WORDS = (
    "apple river mountain music dream garden winter ocean history science story friend city computer language "
    "planet forest coffee travel movie health money weather school animal dog cat bird tree flower sun moon star "
    "love time water fire light book game team road car train house door window phone picture color paint song "
    "dance art food bread cheese chocolate tea summer spring autumn morning night family child teacher doctor king "
    "queen dragon robot castle island desert bridge market library museum village sky cloud rain snow wind storm "
    "energy power future past memory idea question answer problem reason price job work office table chair kitchen "
    "bottle glass cup plate spoon knife fork shirt shoe hat coat dress pocket bag box gift letter paper pencil pen "
    "chalk board screen keyboard mouse cable battery engine wheel airplane boat ship rocket bicycle bus truck "
    "street park beach lake valley hill cave field farm horse cow sheep pig chicken duck rabbit lion tiger bear "
    "wolf fox deer monkey elephant giraffe zebra snake frog fish shark whale turtle spider bee butterfly ant rose "
    "tulip grass leaf seed fruit banana orange grape lemon cherry peach melon tomato potato carrot onion garlic "
    "pepper salt sugar honey butter milk egg rice pasta soup salad pizza burger sandwich cookie cake pie candy "
    "juice wine beer breakfast lunch dinner recipe chef waiter restaurant hotel airport station hospital church "
    "temple palace tower wall gate fence roof floor stairs garage yard neighbor stranger crowd army soldier "
    "captain pilot driver farmer artist writer poet singer actor student scientist engineer lawyer judge police "
    "nurse baker builder painter dancer player coach fan hero villain ghost witch wizard giant fairy angel monster "
    "alien pirate knight prince princess emperor president minister leader country nation state border capital "
    "empire kingdom republic government law rule vote election party debate news article journal magazine novel "
    "poem essay chapter page word sentence grammar spelling dictionary alphabet number symbol sign map compass "
    "clock calendar week month year decade century minute second hour today tomorrow yesterday weekend holiday "
    "birthday wedding festival concert show theater cinema gallery stage camera photo video radio television "
    "internet website email message password account network server software hardware program code data file "
    "folder signal satellite telescope microscope laboratory experiment theory atom molecule cell gene brain heart "
    "blood bone muscle skin eye ear nose mouth tooth hand finger arm leg foot happy sad angry calm brave afraid "
    "proud shy kind cruel honest clever silly quiet loud bright dark warm cold hot cool soft hard heavy fast slow "
    "big small tall short long wide narrow deep shallow young old new ancient modern rich poor strong weak clean "
    "dirty empty full early late easy difficult simple strange beautiful ugly red blue green yellow purple pink "
    "brown black white gray golden silver wooden metal plastic run walk jump swim fly climb sing read write draw "
    "cook eat drink sleep wake think learn teach build break fix open close start stop win lose find hide search "
    "borrow lend buy sell pay send receive listen watch speak whisper shout laugh cry smile remember forget "
    "believe imagine explain describe compare choose decide plan visit explore discover invent create destroy "
    "protect attack defend escape follow lead carry throw catch push pull"
).split()
_TOPICS = ("the sea", "love", "a cat", "winter", "friendship", "the moon", "coffee", "my dog", "a robot",
           "the future", "autumn leaves", "a lost key", "space travel", "the city at night", "breakfast")
_FORMS = ("a poem", "a story", "a song", "an essay", "an email", "a haiku", "a letter", "a tweet", "a summary")
_CONCEPTS = ("gravity", "democracy", "photosynthesis", "machine learning", "inflation", "the internet",
             "black holes", "evolution", "electricity", "climate change", "quantum physics", "a neural network")
_NAMES = ("Albert Einstein", "Marie Curie", "Ada Lovelace", "Napoleon", "Cleopatra", "Alan Turing",
          "Frida Kahlo", "Leonardo da Vinci", "Nelson Mandela", "Isaac Newton")
_CHAT = ("Hi!", "Hello", "hello there", "How are you?", "Thanks!", "What's your name?", "Good morning",
         "Can you help me?", "Who are you?", "Tell me a joke.", "What time is it?", "What's the weather today?",
         "Write some Python code.", "I feel sad today.", "What is the meaning of life?", "Recommend a movie.")
_LANGUAGES = ("French", "German", "Spanish", "Japanese", "Italian")
_OUT_OF_SCOPE = ("Write {form} about {topic}.", "Who is {name}?", "Explain {concept}.", "What is {concept}?",
                 "Translate '{words}' into {language}.", "Tell me about {topic}.", "{chat}", "{words}",
                 "{words}?", "Summarize this: {words}.", "What does '{word}' mean?", "Spell {word} backwards.")


def held_out(*key) -> bool:
    """Whether this operand pair / country belongs to the held-out tenth (never trained on)."""
    return zlib.crc32(repr(key).encode()) % 10 == 0


@dataclass
class Task:
    """A prompt and what a correct answer contains. `family`: add, sub, calculator, capital, sort, refusal, mul."""

    family: str
    messages: list[dict]
    tools: list[dict] | None
    answer: str  # the final content the model should give
    call: dict | None = None  # tool tasks: {"name": ..., "arguments": {...}} the model should emit
    result: str | None = None  # tool tasks: what the tool returns


def run_tool(name: str, arguments: dict) -> str:
    """Execute one of the built-in tools; a bad call returns an error string, as a tool server would."""
    if name == "calculator":
        m = re.fullmatch(r"\s*(\d+)\s*([*/])\s*(\d+)\s*", str(arguments.get("expression", "")))
        if m is None:
            return "error: expected two whole numbers joined by * or /"
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        if op == "*":
            return str(a * b)
        if b == 0:
            return "error: division by zero"
        return str(a // b) if a % b == 0 else f"{a / b:.4g}"
    if name == "get_capital":
        return CAPITALS.get(str(arguments.get("country", "")).strip(), "unknown country")
    return f"error: no tool named {name}"


# ---- arithmetic ----

def _digits(n: int) -> list[int]:
    return [int(d) for d in reversed(str(n))]  # ones first


def add_reasoning(a: int, b: int) -> str:
    """Column addition from the ones digit, one line per column with the answer's digits so far after the colon:
    "7+5=12, carry 1: 2", "2+8+1=11, carry 1: 12", "1+3+1=5: 512" (each line copies the last and puts one digit in
    front, so the final answer is a copy of the last line)."""
    da, db = _digits(a), _digits(b)
    lines, carry, done = [], 0, ""
    for i in range(max(len(da), len(db))):
        x, y = (da[i] if i < len(da) else 0), (db[i] if i < len(db) else 0)
        s = x + y + carry
        done = str(s % 10) + done
        lines.append(f"{x}+{y}{'+1' if carry else ''}={s}{', carry 1' if s > 9 else ''}: {done}")
        carry = s // 10
    if carry:
        lines.append(f"carry 1: 1{done}")
    return "\n".join(lines)


def compare_line(a: int, b: int) -> str:
    """Which of two numbers is larger, worked from the left: by digit count, else digit by digit to the first that
    differs ("272 vs 255: 2=2, 7>5, so 272>255", "716 vs 62: 3 digits vs 2, so 716>62")."""
    rel = "=" if a == b else (">" if a > b else "<")
    sa, sb = str(a), str(b)
    if len(sa) != len(sb):
        return f"{a} vs {b}: {len(sa)} digits vs {len(sb)}, so {a}{rel}{b}"
    steps = []
    for x, y in zip(sa, sb):
        steps.append(f"{x}{'=' if x == y else '>' if x > y else '<'}{y}")
        if x != y:
            break
    return f"{a} vs {b}: {', '.join(steps)}, so {a}{rel}{b}"


def sub_reasoning(a: int, b: int) -> str:
    """Which is larger first (`compare_line`), then column subtraction from the ones digit (the larger minus the
    smaller), one line per column: the column's digits first, then whether it borrows, then the digits so far after
    the colon: "2-4 needs a borrow: 12-4=8: 8", "0-1-7 needs a borrow: 10-1-7=2: 28", "9-1-1=7: 728"; leading zeros
    dropped on a last line."""
    lines = [compare_line(a, b)]
    if a < b:
        lines.append(f"{a}-{b}=-({b}-{a})")
        a, b = b, a
    da, db = _digits(a), _digits(b)
    borrow, done = 0, ""
    for i in range(len(da)):
        x, y = da[i], (db[i] if i < len(db) else 0)
        owe = x - borrow < y
        d = 10 * owe + x - borrow - y
        done = str(d) + done
        less = f"{'-1' if borrow else ''}-{y}"
        step = f"{x}{less} needs a borrow: {10 + x}{less}" if owe else f"{x}{less}"
        lines.append(f"{step}={d}: {done}")
        borrow = int(owe)
    if done != str(a - b):
        lines.append(f"without leading zeros: {a - b}")
    return "\n".join(lines)


def digit_product_lines(a: int, d: int) -> list[str]:
    """a x one digit d, column by column from a's ones digit, as the addition working goes: the product of the
    column, its carry added in the next, the digits so far after the colon: "7 * 6=42, carry 4: 2",
    "4 * 6+4=24+4=28: 282"; times 0 one line, "47 * 0=0". The sign is " *" as in the calculator's calls: a bare
    "*" the built-in model never wrote, and adapters cannot make it likely (its loss stayed at 2.8)."""
    if d == 0:
        return [f"{a} * 0=0"]
    lines, carry, done = [], 0, ""
    digits = _digits(a)
    for i, x in enumerate(digits):
        p = x * d
        s = p + carry
        last = i == len(digits) - 1
        done = (str(s) if last else str(s % 10)) + done
        step = f"{x} * {d}+{carry}={p}+{carry}={s}" if carry else f"{x} * {d}={p}"
        lines.append(f"{step}{f', carry {s // 10}' if s > 9 and not last else ''}: {done}")
        carry = s // 10
    return lines


def mul_reasoning(a: int, b: int) -> str:
    """Two-digit multiplication as a model this small can follow it: a x b's ones digit, then a x b's tens digit
    (a header line "47 * 6:" before each, `digit_product_lines`), then the two partial products added ("282+1410:",
    the tens' with a 0 put after it) with the addition's own column working (`add_reasoning`)."""
    tens, ones = divmod(b, 10)
    lines = [f"{a} * {ones}:", *digit_product_lines(a, ones), f"{a} * {tens}:", *digit_product_lines(a, tens)]
    low, high = a * ones, a * tens * 10
    lines += [f"{low}+{high}:", add_reasoning(low, high)]
    return "\n".join(lines)


OPERAND_DRAWS = {"uniform": 0.66, "digits": 0.28, "close": 0.06}  # training's mix (the quality test's: uniform)


def _operands(rng: random.Random, draw: str) -> tuple[int, int]:
    """Two operands: "uniform" in 0..999; "digits": of 1, 2 or 3 digits each; "close": within 40 of each other, so
    the comparison that opens a subtraction runs to the second or third digit (1 uniform pair in 10 does; without
    these the model's tens comparisons were its one weak spot, 93% of differences right)."""
    if draw == "uniform":
        return rng.randint(0, 999), rng.randint(0, 999)
    if draw == "digits":
        return rng.randint(0, 10 ** rng.randint(1, 3) - 1), rng.randint(0, 10 ** rng.randint(1, 3) - 1)
    a = rng.randint(0, 999)
    return a, min(999, max(0, a + rng.randint(-40, 40)))


def arithmetic_task(rng: random.Random, op: str, heldout: bool, draw: str = "uniform") -> tuple[Task, str]:
    """An addition or subtraction task and its working; operands (`_operands`) from the held-out or the training
    pairs."""
    while True:
        a, b = _operands(rng, draw)
        if held_out(a, op, b) == heldout:
            break
    value, prompts, reasoning = ((a + b, ADD_PROMPTS, add_reasoning(a, b)) if op == "+" else
                                 (a - b, SUB_PROMPTS, sub_reasoning(a, b)))
    prompt = rng.choice(prompts).format(a=a, b=b)
    task = Task("add" if op == "+" else "sub", [{"role": "user", "content": prompt}], None, f"{a} {op} {b} = {value}")
    return task, reasoning


def sum_statements(n: int, seed: int, heldout: bool = False, digits: int = 2, working: bool = False) -> list[dict]:
    """Labelled texts for a classifier, {"text": "37 + 48 = 85", "label": "correct" | "wrong"}: operands of up to
    `digits` digits (the held-out pairs or the training ones, as `held_out` splits them), half the sums right and
    half near misses, off by 1, 2, 9, 10 or 11 (a digit or a carry wrong). working: the column working first, as
    the built-in model writes it ("37 + 48\n7+8=15, carry 1: 5\n3+4+1=8: 85\n37 + 48 = 85"), right, and the
    wrong statements' answer a near miss of it."""
    rng = random.Random(seed)
    top = 10 ** digits - 1
    out = []
    while len(out) < n:
        a, b = rng.randint(0, top), rng.randint(0, top)
        if held_out(a, "+", b) != heldout:
            continue
        wrong = len(out) % 2 == 1
        value = a + b + (rng.choice((-11, -10, -9, -2, -1, 1, 2, 9, 10, 11)) if wrong else 0)
        if value < 0:
            continue
        text = f"{a} + {b}\n{add_reasoning(a, b)}\n{a} + {b} = {value}" if working else f"{a} + {b} = {value}"
        out.append({"text": text, "label": "wrong" if wrong else "correct"})
    return out


def multiplication_task(rng: random.Random, heldout: bool) -> tuple[Task, str]:
    """Two two-digit numbers (10-99) to multiply and the working (`mul_reasoning`), from the held-out or the
    training pairs. Not one of the built-in model's families: a new task to fine-tune it on."""
    while True:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if held_out(a, "*", b) == heldout:
            break
    prompt = rng.choice(MUL_PROMPTS).format(a=a, b=b)
    return Task("mul", [{"role": "user", "content": prompt}], None, f"{a} * {b} = {a * b}"), mul_reasoning(a, b)


TIMES_PROMPT = "Times table: {}"


def times_facts(rng: random.Random) -> tuple[str, str]:
    """4-8 one-digit products as the multiplication working writes them ("7 * 6=42", "4 * 6+4=24+4=28"): the table
    that working needs, many facts to a short conversation. Returns (prompt, answer)."""
    facts = []
    for _ in range(rng.randint(4, 8)):
        x, d, carry = rng.randint(0, 9), rng.randint(1, 9), rng.choice([0, 0, 0, 0] + list(range(1, 9)))
        facts.append((f"{x} * {d}", f"{x} * {d}={x * d}") if not carry else
                     (f"{x} * {d}+{carry}", f"{x} * {d}+{carry}={x * d}+{carry}={x * d + carry}"))
    return TIMES_PROMPT.format(", ".join(q for q, _ in facts)), "\n".join(a for _, a in facts)


# ---- tools ----

def calculator_task(rng: random.Random, heldout: bool) -> Task:
    while True:
        if rng.random() < 0.5:
            op, a, b = "*", rng.randint(10, 9999), rng.randint(10, 999)
        else:
            b, q = rng.randint(2, 999), rng.randint(10, 9999)
            op, a = "/", b * q
        if held_out(a, op, b) == heldout:
            break
    prompt = rng.choice(MUL_PROMPTS if op == "*" else DIV_PROMPTS).format(a=a, b=b)
    expression = f"{a} {op} {b}"
    result = run_tool("calculator", {"expression": expression})
    return Task("calculator", [{"role": "user", "content": prompt}], TOOLS, f"{expression} = {result}",
                {"name": "calculator", "arguments": {"expression": expression}}, result)


_SYLLABLES = ("ba", "co", "da", "fe", "gi", "ka", "lo", "ma", "ne", "ri", "sa", "to", "vi", "zu", "mor", "tan",
              "vel", "dor", "lin", "ska", "bur", "quo", "wen", "hal", "ir", "os", "un", "el")
_PREFIXES = ("New", "North", "South", "East", "West", "San", "Port", "Saint")
_SUFFIXES = ("ia", "land", "stan", "a", "o", "burg", "ville", "")


def invented_place(rng: random.Random) -> str:
    """A made-up place name ("Velmoria", "North Tandor", "Port Kasa"): training conversations look up invented
    countries too, so the model learns to copy names from the prompt and the tool's response instead of learning
    the table by heart."""
    while True:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) + rng.choice(_SUFFIXES)
        name = name.capitalize()
        if rng.random() < 0.2:
            name = f"{rng.choice(_PREFIXES)} {name}"
        if len(name) >= 4 and name not in CAPITALS and name not in CAPITALS.values():
            return name


def _table_country(rng: random.Random, heldout: bool) -> str:
    return rng.choice([c for c in CAPITALS if held_out(c) == heldout])


def capital_task(rng: random.Random, heldout: bool, invented: bool = False) -> Task:
    """A get_capital task over the table, or (`invented`, training only) over a made-up country whose made-up
    capital is what the tool's response says."""
    if invented:
        country, capital = invented_place(rng), invented_place(rng)
    else:
        country = _table_country(rng, heldout)
        capital = CAPITALS[country]
    prompt = rng.choice(CAPITAL_PROMPTS).format(c=country)
    return Task("capital", [{"role": "user", "content": prompt}], TOOLS, f"The capital of {country} is {capital}.",
                {"name": "get_capital", "arguments": {"country": country}}, capital)


def tool_conversation(task: Task, thinking: bool) -> list[dict]:
    """The whole exchange: the call, the tool's response, the answer from it."""
    call = {"type": "function", "function": {"name": task.call["name"], "arguments": task.call["arguments"]}}
    first = {"role": "assistant", "content": "", "tool_calls": [call]}
    final = {"role": "assistant", "content": task.answer}
    if thinking:
        what = (f"I will use the calculator for {task.call['arguments']['expression']}." if task.family == "calculator"
                else f"I will look up the capital of {task.call['arguments']['country']}.")
        first["reasoning_content"] = what
        final["reasoning_content"] = f"The tool returned {task.result}."
    return [*task.messages, first, {"role": "tool", "content": task.result}, final]


# ---- sorting and refusals ----

def sort_task(rng: random.Random, heldout: bool) -> tuple[Task, str]:
    while True:
        xs = [rng.randint(0, 99) for _ in range(rng.randint(3, 5))]
        if held_out(*xs) == heldout:
            break
    down = rng.random() < 0.4
    prompt = rng.choice(SORT_DOWN_PROMPTS if down else SORT_PROMPTS).format(xs=", ".join(map(str, xs)))
    ordered = sorted(xs, reverse=down)
    reasoning = (" > " if down else " < ").join(map(str, ordered)) if len(set(xs)) == len(xs) else \
        (" >= " if down else " <= ").join(map(str, ordered))
    return Task("sort", [{"role": "user", "content": prompt}], None, ", ".join(map(str, ordered))), reasoning


def _random_words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))


def refusal_prompt(rng: random.Random) -> str:
    """Something outside the families: prose requests, chit-chat, word salad, calculator questions without tools."""
    r = rng.random()
    if r < 0.1:
        return rng.choice(MUL_PROMPTS + DIV_PROMPTS).format(a=rng.randint(10, 9999), b=rng.randint(2, 999))
    if r < 0.15:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ?!") for _ in range(rng.randint(3, 30))).strip() or "?"
    return rng.choice(_OUT_OF_SCOPE).format(
        form=rng.choice(_FORMS), topic=rng.choice(_TOPICS), name=rng.choice(_NAMES), concept=rng.choice(_CONCEPTS),
        words=_random_words(rng, 2, 9), language=rng.choice(_LANGUAGES), chat=rng.choice(_CHAT),
        word=rng.choice(_WORDS))


def no_tool_capital(rng: random.Random, heldout: bool) -> tuple[str, str]:
    """A capital question with no tools on offer: the answer names the country (copying names is what the tool
    calls need too), about a training country or, mostly, a made-up one. Returns (prompt, answer)."""
    invented = not heldout and rng.random() < INVENTED_COUNTRIES
    country = invented_place(rng) if invented else _table_country(rng, heldout)
    return (rng.choice(CAPITAL_PROMPTS).format(c=country),
            f"I can't look up the capital of {country} without my get_capital tool.")


# ---- copying ----

COPY_PROMPTS = ["Repeat after me: {s}", "Repeat this: {s}", "Please repeat: {s}", "Say this back to me: {s}"]
COPY_REASONING = "The user wants these words repeated."


def _copy_word(rng: random.Random, heldout: bool) -> str:
    """A word to repeat: a common word, a made-up name or random letters, in any case; held out or not as asked
    (held-out countries are held-out words, so training never repeats one)."""
    while True:
        r = rng.random()
        if r < 0.3:
            word = rng.choice(_WORDS)
        elif r < 0.6:
            word = invented_place(rng).split()[-1]
        else:
            word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        word = word.capitalize() if rng.random() < 0.6 else word.lower()
        if held_out(word) == heldout:
            return word


def copy_task(rng: random.Random, heldout: bool) -> Task:
    """Repeat 1-6 words back: the skill behind copying a name from the question into a tool call. The words follow
    a space in the prompt and open the reply (the call's argument opens its line too), or open a line of the prompt
    and follow "Sure: " in the reply (as a capital from the tool's response does in the answer)."""
    words = " ".join(_copy_word(rng, heldout) for _ in range(rng.randint(1, 6)))
    if rng.random() < 0.7:
        return Task("copy", [{"role": "user", "content": rng.choice(COPY_PROMPTS).format(s=words)}], None, words)
    return Task("copy", [{"role": "user", "content": f"Repeat after me:\n{words}"}], None, f"Sure: {words}")


# ---- conversations ----

# tool conversations carry the ~350-token tool system prompt: few of them already cost half the tokens
FAMILY_WEIGHTS = {"add": 0.30, "sub": 0.40, "calculator": 0.04, "capital": 0.06, "sort": 0.03, "refusal": 0.08,
                  "capital without tools": 0.05, "copy": 0.04}
# copying is learned all at once after thousands of examples (an induction head forming): the first quarter of a
# training run is mostly copying. `copy_share` is drawn before the families' own draw (which has copying too): 62%
# of the first quarter, ~8% from half-way on
COPY_WARMUP = (0.6, 0.25, 0.5)  # (share, until this fraction of the run, down to FAMILY_WEIGHTS' by this one)
INVENTED_COUNTRIES = 0.6  # share of training get_capital conversations about made-up countries
# the replay in a multiplication fine-tune: the calculator questions share the new task's prompts (tools on offer
# and large numbers: call it; none and two digits: work it out), so they and copying, which drift most, get more
REPLAY_WEIGHTS = {"add": 0.17, "sub": 0.35, "calculator": 0.15, "capital": 0.08, "sort": 0.03, "refusal": 0.05,
                  "capital without tools": 0.02, "copy": 0.15}


def _answer(task_content: str, reasoning: str, thinking: bool) -> dict:
    turn = {"role": "assistant", "content": task_content}
    if thinking:
        turn["reasoning_content"] = reasoning
    return turn


def arithmetic_answer(task: Task, working: str, thinking: bool) -> dict:
    """The working inside <think> and the bare `a op b = c` after it; without thinking the same working opens the
    reply, a blank line before `a op b = c`: a model this small cannot carry in its head (trained on bare answers
    alone it gets 2% of sums right), and one form of working serves both modes."""
    return _answer(task.answer if thinking else f"{working}\n\n{task.answer}", working, thinking)


def conversation(rng: random.Random, family: str, thinking: bool, heldout: bool = False) -> dict:
    """One training (or held-out) conversation of a family: {"messages": [...], "tools": [...]?}."""
    tools = None
    if family in ("add", "sub"):
        draw = rng.choices(list(OPERAND_DRAWS), list(OPERAND_DRAWS.values()))[0]
        task, reasoning = arithmetic_task(rng, "+" if family == "add" else "-", heldout, draw)
        messages = [*task.messages, arithmetic_answer(task, reasoning, thinking)]
        if rng.random() < 0.05:
            tools = TOOLS  # tools on offer do not change how the model adds
    elif family == "mul":
        task, reasoning = multiplication_task(rng, heldout)
        messages = [*task.messages, arithmetic_answer(task, reasoning, thinking)]
    elif family in ("calculator", "capital"):
        task = (calculator_task(rng, heldout) if family == "calculator" else
                capital_task(rng, heldout, invented=not heldout and rng.random() < INVENTED_COUNTRIES))
        messages, tools = tool_conversation(task, thinking), TOOLS
    elif family == "capital without tools":
        prompt, answer = no_tool_capital(rng, heldout)
        messages = [{"role": "user", "content": prompt}, _answer(answer, NO_TOOL_REASONING, thinking)]
    elif family == "copy":
        task = copy_task(rng, heldout)
        messages = [*task.messages, _answer(task.answer, COPY_REASONING, thinking)]
    elif family == "sort":
        task, reasoning = sort_task(rng, heldout)
        messages = [*task.messages, _answer(task.answer, reasoning, thinking)]
    else:
        messages = [{"role": "user", "content": refusal_prompt(rng)}, _answer(REFUSAL, REFUSAL_REASONING, thinking)]
    return {"messages": messages, **({"tools": tools} if tools else {})}


def copy_share(progress: float) -> float:
    """The chance that a conversation at this point of a training run (0 = its start, 1 = its end) is a copy
    before the families are drawn: COPY_WARMUP."""
    share, until, back = COPY_WARMUP
    base = FAMILY_WEIGHTS["copy"]
    if progress <= until:
        return share
    return base + (share - base) * max(0.0, (back - progress) / (back - until))


def conversations(n: int, seed: int, heldout: bool = False, curriculum: bool = False,
                  weights: dict[str, float] | None = None) -> list[dict]:
    """n conversations drawn by `weights` (default FAMILY_WEIGHTS), thinking on for about half; some continue a
    finished exchange, some open with a system message. `curriculum`: in training order, copying first
    (`copy_share`)."""
    rng = random.Random(seed)
    weights = weights or FAMILY_WEIGHTS
    families, weights = list(weights), list(weights.values())
    out = []
    for i in range(n):
        copying = curriculum and rng.random() < copy_share(i / n)
        family = "copy" if copying else rng.choices(families, weights)[0]
        example = conversation(rng, family, rng.random() < 0.5, heldout)
        if "tools" not in example and rng.random() < 0.08:
            first = conversation(rng, rng.choice(["add", "sub", "sort", "refusal"]), False, heldout)
            example["messages"] = first["messages"] + example["messages"]
        if rng.random() < 0.1:
            example["messages"].insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        out.append(example)
    return out


def multiplication_conversations(n: int, seed: int, replay: float = 0.0, heldout: bool = False,
                                 facts: float = 0.0) -> list[dict]:
    """n conversations for fine-tuning the built-in model to multiply: two-digit products ("mul"), thinking on for
    about half; a `facts` share of one-digit drills (`times_facts`, thinking off); a `replay` share of the built-in
    model's own families (`conversations`, drawn by REPLAY_WEIGHTS), so that what it knew stays."""
    if not (0 <= replay <= 1 and 0 <= facts <= 1 - replay):
        raise ValueError(f"replay and facts must be shares in [0, 1] together, not {replay!r} and {facts!r}")
    pick, rng = random.Random(seed), random.Random(seed + 2)
    kinds = [pick.random() for _ in range(n)]
    old = iter(conversations(sum(k < replay for k in kinds), seed + 1, heldout, weights=REPLAY_WEIGHTS))
    out = []
    for k in kinds:
        if k < replay:
            out.append(next(old))
        elif k < replay + facts:
            prompt, answer = times_facts(rng)
            out.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
        else:
            out.append(conversation(rng, "mul", rng.random() < 0.5, heldout))
    return out


def copy_conversations(n: int, seed: int) -> list[dict]:
    """n "repeat after me" conversations, thinking on for about half: the recipe opens with these alone."""
    rng = random.Random(seed)
    return [conversation(rng, "copy", rng.random() < 0.5) for _ in range(n)]


def quality_tasks(family: str, n: int, seed: int) -> list[Task]:
    """n held-out tasks of a family for the quality test (operands uniform in 0..999 for arithmetic)."""
    rng = random.Random(seed)
    if family in ("add", "sub"):
        return [arithmetic_task(rng, "+" if family == "add" else "-", True)[0] for _ in range(n)]
    if family == "mul":
        return [multiplication_task(rng, True)[0] for _ in range(n)]
    if family == "calculator":
        return [calculator_task(rng, True) for _ in range(n)]
    if family == "capital":
        return [capital_task(rng, True) for _ in range(n)]
    if family == "sort":
        return [sort_task(rng, True)[0] for _ in range(n)]
    if family == "copy":
        return [copy_task(rng, True) for _ in range(n)]
    raise ValueError(f"unknown family {family!r}")
