"""Build this project's own training and evaluation prompts, deterministically from a seed.

    python data/make_prompts.py                     # writes the two default files below
    python data/make_prompts.py --seed 0 --num-coding 2400 --num-chat 1600 \
        --train-out data/prompts/train_prompts.jsonl --eval-out data/eval_prompts.jsonl

Every prompt is written here, from two sources and nothing else (no public evaluation set's
prompts: no HumanEval, MBPP, GSM8K, MATH, MT-Bench or Alpaca):
  - coding prompts: templates ("explain", "write tests for", "reimplement", ...) filled with the
    public functions and classes of Python standard-library modules, found with `inspect`
    (the first sentence of each docstring becomes the task description);
  - chat prompts: templates (explain a concept, write an email, how-to, compare, list ideas, ...)
    filled with topic lists written in this file.
The evaluation prompts fill the same templates with *different* stdlib modules and *different* topic
lists and texts than the training prompts, except the arithmetic word problems: both draw random numbers
into the same WORD_PROBLEMS templates, so the evaluation's word problems differ from some training
prompts only in their numbers (the shipped files: 2 of the 40). Only an evaluation prompt whose whole text
is also a training prompt is refused (checked before writing). Training's own word problems may repeat a
text (the shipped file: one, twice); drawing them otherwise would change the shipped files.

Output format (the decoding CLI's prompt format), one JSON object per line:
    {"id": "code/textwrap.dedent/explain", "messages": [{"role": "user", "content": "..."}]}

The stdlib contents depend on the Python minor version (this file was run with 3.11); the seed
fixes everything else.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import sys
from pathlib import Path

from ddtree.errors import CommandParser, DDTreeError, command
from ddtree.files import atomic_file, check_output_file, path_type

SHIPPED_PYTHON = (3, 11)  # the Python whose standard library wrote the shipped files (3.11.7, data/README.md)
SHIPPED_FILES = {Path(__file__).resolve().parent / "eval_prompts.jsonl",
                 Path(__file__).resolve().parent / "prompts" / "train_prompts.jsonl"}

# ----------------------------------------------------------------------------- stdlib sources

# Modules whose objects feed the training prompts. Imported by name; `os.path` is shown as such
# even though its objects live in posixpath.
TRAIN_MODULES = [
    "abc", "argparse", "array", "ast", "base64", "binascii", "bisect", "calendar", "cmath",
    "collections", "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.utils", "enum", "fnmatch", "fractions", "functools",
    "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "http.cookies", "io",
    "ipaddress", "itertools", "json", "keyword", "logging", "math", "mimetypes", "numbers",
    "operator", "os.path", "pathlib", "pickle", "pprint", "queue", "quopri", "random", "re",
    "reprlib", "sched", "secrets", "shlex", "shutil", "statistics", "string", "struct",
    "tempfile", "textwrap", "threading", "time", "tokenize", "types", "unicodedata",
    "urllib.parse", "uuid", "weakref", "zipfile", "zlib",
]

# Held-out modules for the evaluation prompts: none of them appears above.
EVAL_MODULES = [
    "codecs", "filecmp", "getopt", "linecache", "netrc", "sqlite3", "stat", "timeit",
    "xml.etree.ElementTree", "zoneinfo",
]

# {qual} = module.name, {name} = bare name, {module}, {summary} = first docstring sentence,
# {signature} = name(params) or name(...) when introspection cannot tell.
FUNCTION_TEMPLATES = {
    "explain": "Explain what `{qual}` does and show an example of using it.",
    "explain-beginner": "I'm new to Python. What does `{qual}` do, and when would I use it? Give a short example.",
    "write-like": "Write a Python function `{name}` that works like `{qual}`: {summary}",
    "reimplement": "Reimplement `{qual}` in pure Python without importing `{module}`. Its documentation says: \"{summary}\" Keep the same signature where you can.",
    "tests": "Write unit tests with pytest for `{qual}`. Cover normal use and edge cases.",
    "pitfalls": "What are common mistakes people make when using `{qual}`? Show the wrong and the right way.",
    "practical": "Show a practical, complete Python script that uses `{qual}` to solve a real task, and explain each step.",
    "docstring": "Write a clear docstring (with Args, Returns and an example) for a function with the signature `{signature}` whose purpose is: {summary}",
    "typed": "Write a type-annotated Python function that does the following, in the style of `{qual}`: {summary}",
}

CLASS_TEMPLATES = {
    "explain": "Explain the `{qual}` class: what it is for, its main methods, and an example.",
    "simplified": "Write a simplified version of `{qual}` as a small Python class. The original is described as: \"{summary}\"",
    "tests": "Write pytest unit tests for the main behaviour of `{qual}`.",
    "when-to-use": "When should I use `{qual}` instead of writing my own class? Give an example of each.",
    "practical": "Show how to use `{qual}` in a short, realistic program and explain the output.",
}

# Module-level prompts, one per module per template.
MODULE_TEMPLATES = {
    "overview": "Give an overview of Python's `{module}` module: what it is for and its most useful functions, with examples.",
    "cheatsheet": "Write a short cheat sheet for the Python `{module}` module.",
}


def first_sentence(doc: str) -> str:
    """The docstring's first sentence, one line, without a leading signature line."""
    lines = [line.strip() for line in doc.strip().splitlines()]
    # Some docstrings start with a call signature, e.g. "getopt(args, options) -> opts, args".
    while lines and re.match(r"^[\w.]+\s*\(.*\)\s*(->.*)?$", lines[0]):
        lines.pop(0)
    paragraph = []
    for line in lines:
        if not line:
            if paragraph:
                break
            continue
        paragraph.append(line)
    text = " ".join(paragraph)
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    sentence = match.group(1) if match else text
    sentence = sentence.strip()
    if sentence:
        sentence = sentence[0].upper() + sentence[1:]
        if sentence[-1] not in ".!?":
            sentence += "."
    return sentence


def stdlib_objects(module_name: str) -> list[dict]:
    """Public functions and classes defined in a stdlib module that carry a usable docstring."""
    module = importlib.import_module(module_name)
    home = {module.__name__, module_name}
    found = []
    for name in sorted(vars(module)):
        if name.startswith("_"):
            continue
        obj = getattr(module, name)
        is_class = inspect.isclass(obj)
        if not (is_class or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        if getattr(obj, "__module__", None) not in home:
            continue  # re-exported from elsewhere
        if is_class and issubclass(obj, BaseException):
            continue  # exception classes make dull prompts
        doc = inspect.getdoc(obj) or ""
        summary = first_sentence(doc)
        # Too short to describe a task, or too long to fit in a prompt.
        if len(summary) < 20 or len(summary) > 300:
            continue
        try:
            signature = f"{name}{inspect.signature(obj)}"
        except (TypeError, ValueError):
            signature = f"{name}(...)"
        # Defaults such as <function IS_CHARACTER_JUNK at 0x7f...> would make the output differ per run.
        signature = re.sub(r"<(?:function|built-in function|class) ([\w.]+)(?: at 0x[0-9a-f]+)?>", r"\1", signature)
        signature = re.sub(r" at 0x[0-9a-f]+", "", signature)
        found.append({
            "module": module_name, "name": name, "qual": f"{module_name}.{name}",
            "summary": summary, "signature": signature, "kind": "class" if is_class else "function",
        })
    return found


def coding_candidates(modules: list[str]) -> list[dict]:
    """All (id, content) coding prompts from every template x every object of the modules."""
    candidates = []
    for module_name in modules:
        for key, template in MODULE_TEMPLATES.items():
            candidates.append({"id": f"code/{module_name}/{key}", "module": module_name, "content": template.format(module=module_name)})
        for obj in stdlib_objects(module_name):
            templates = CLASS_TEMPLATES if obj["kind"] == "class" else FUNCTION_TEMPLATES
            for key, template in templates.items():
                candidates.append({"id": f"code/{obj['qual']}/{key}", "module": module_name, "content": template.format(**obj)})
    return candidates


# ----------------------------------------------------------------------------- chat sources

# Each category: a list of templates ({x} or {a}/{b}) and a list of training topics. The
# evaluation topics below are separate lists, so no topic appears in both files.
CHAT_TEMPLATES = {
    "explain": [
        "Explain {x} in simple terms.",
        "Can you explain {x} to a curious high-school student?",
        "What is {x}, and why does it matter?",
        "Give me a clear, short explanation of {x} with one everyday example.",
        "Explain {x} in three short paragraphs.",
        "I never understood {x}. Could you walk me through it?",
        "What are the key ideas behind {x}?",
    ],
    "email": [
        "Write a short, polite email {x}.",
        "Draft a friendly email {x}. Keep it under 150 words.",
        "Help me write a professional email {x}.",
    ],
    "howto": [
        "How do I {x}? Give step-by-step instructions.",
        "Give me a step-by-step guide to {x}.",
        "What is the easiest way to {x}? List the steps.",
        "I want to {x}. Where should I start?",
        "What mistakes should I avoid when I {x}?",
        "Explain how to {x}, as if to a complete beginner.",
    ],
    "compare": [
        "Compare {a} and {b}.",
        "What are the main differences between {a} and {b}?",
        "{A} or {b}: what are the pros and cons of each?",
        "Make a short table comparing {a} with {b}.",
        "Help me choose between {a} and {b}.",
    ],
    "ideas": [
        "List ten ideas for {x}.",
        "Give me five creative ideas for {x}, with one sentence on each.",
        "Brainstorm some ideas for {x}.",
        "I need inspiration for {x}. Suggest a few options and explain why each works.",
    ],
    "summarise": [
        "Summarise the main arguments for and against {x}.",
        "Give a balanced summary of the debate about {x}.",
        "Summarise in five bullet points what someone should know about {x}.",
    ],
    "write": [
        "Write a short poem about {x}.",
        "Write a short story (about 200 words) about {x}.",
        "Write a haiku about {x}.",
        "Write a product description for {x}.",
    ],
    "advice": [
        "What advice would you give to someone {x}?",
        "I am {x}. What should I keep in mind?",
        "Give practical tips for someone {x}.",
        "My friend is {x}. What are the three most important things they should know?",
    ],
}

TRAIN_TOPICS = {
    "explain": [
        "photosynthesis", "inflation", "compound interest", "the water cycle", "plate tectonics",
        "natural selection", "supply and demand", "the greenhouse effect", "how vaccines work",
        "black holes", "the theory of relativity", "DNA replication", "opportunity cost",
        "the stock market", "machine learning", "public-key cryptography", "how the internet works",
        "the immune system", "climate versus weather", "entropy", "the scientific method",
        "how a bill becomes law", "the placebo effect", "gravity", "the Doppler effect",
        "how batteries work", "recursion", "blockchain", "how airplanes fly", "circadian rhythms",
        "the Pythagorean theorem", "probability", "the French Revolution", "the Renaissance",
        "the Industrial Revolution", "how memory works in the brain", "plant pollination",
        "ocean tides", "how a refrigerator works", "the food chain", "cognitive biases",
        "interest rates", "the electoral college", "how GPS works", "nuclear fusion",
        "antibiotic resistance", "the speed of light", "how search engines rank pages",
        "volcanoes", "the Big Bang", "how credit scores work", "the nitrogen cycle",
        "exponential growth", "how a compiler works", "the Silk Road", "tectonic earthquakes",
        "how noise-cancelling headphones work", "the causes of seasons", "the law of averages",
        "gross domestic product", "how solar panels work", "the human heart",
    ],
    "email": [
        "asking my manager for a day off next Friday", "thanking a colleague for their help on a project",
        "declining a meeting invitation", "following up after a job interview",
        "asking a professor for an extension on an assignment", "apologising for missing a deadline",
        "inviting the team to a farewell lunch", "requesting a refund for a damaged product",
        "introducing myself to a new client", "reminding a customer about an unpaid invoice",
        "asking a landlord to fix a leaking tap", "announcing a change in office hours",
        "congratulating a friend on a new job", "asking for feedback on a presentation",
        "rescheduling a dentist appointment", "welcoming a new team member",
        "asking a neighbour to keep the noise down", "requesting a letter of recommendation",
        "confirming the details of a booking", "resigning from my position politely",
        "asking a supplier for a quote", "sharing meeting notes with the team",
    ],
    "howto": [
        "learn to cook rice properly", "start running as a beginner", "write a good CV",
        "prepare for a job interview", "start a vegetable garden", "save money on groceries",
        "learn a new language", "make a monthly budget", "improve my sleep", "clean a laptop keyboard",
        "change a flat bicycle tyre", "brew good coffee at home", "write a cover letter",
        "organise a small conference", "back up my photos", "make bread from scratch",
        "learn to play the guitar", "prepare for a marathon", "set up a home aquarium",
        "study effectively for exams", "reduce my screen time", "plan a road trip",
        "paint a room", "give a good presentation", "start journaling", "meditate",
        "negotiate a salary", "train a puppy to sit", "make a podcast", "compost kitchen waste",
        "learn touch typing", "write a short story", "take better photos with a phone",
        "set up a small home office", "make a website for a small business", "care for a houseplant",
    ],
    "compare": [
        ("cats", "dogs as pets"), ("renting", "buying a home"), ("electric cars", "petrol cars"),
        ("tea", "coffee"), ("e-books", "paper books"), ("working from home", "working in an office"),
        ("running", "swimming for fitness"), ("Python", "JavaScript for beginners"),
        ("trains", "planes for travel in Europe"), ("savings accounts", "index funds"),
        ("a laptop", "a desktop computer"), ("public schools", "private schools"),
        ("solar power", "wind power"), ("democracy", "monarchy"), ("cities", "the countryside to live in"),
        ("yoga", "pilates"), ("Android", "iOS"), ("learning alone", "learning in a group"),
        ("credit cards", "debit cards"), ("SQL databases", "NoSQL databases"),
        ("summer", "winter holidays"), ("podcasts", "audiobooks"), ("freelancing", "full-time employment"),
        ("paper notes", "digital notes"), ("chess", "go"),
    ],
    "ideas": [
        "a child's birthday party", "a rainy weekend", "a team-building day", "a science fair project",
        "healthy breakfasts", "a small business in my town", "reducing plastic at home",
        "gifts for a friend who loves books", "a blog about travel", "a school fundraiser",
        "names for a bakery", "a mobile app", "a YouTube channel about cooking",
        "a date night at home", "exercises without equipment", "a garden in a small balcony",
        "a community event", "a short film", "learning maths in a fun way", "a weekend in the mountains",
        "making a commute more pleasant", "a board game night", "using leftover vegetables",
        "a newsletter for a hobby club", "a holiday on a budget",
    ],
    "summarise": [
        "a four-day working week", "school uniforms", "nuclear power", "remote learning",
        "social media for teenagers", "a universal basic income", "banning cars from city centres",
        "homework in primary school", "space exploration budgets", "zoos", "standardised testing",
        "daylight saving time", "self-driving cars", "cryptocurrency", "open-plan offices",
        "tourism in small towns", "a sugar tax", "lowering the voting age",
    ],
    "write": [
        "the sea at night", "a lost umbrella", "the first day of spring", "an old library",
        "a robot learning to paint", "a cup of tea", "a city waking up", "a lighthouse keeper",
        "autumn leaves", "a long train journey", "a friendly dragon", "the moon", "a mountain village",
        "a reusable water bottle", "a noise-cancelling pair of headphones", "a handmade wooden chair",
        "a garden after rain", "a forgotten letter", "a cat who wants to fly", "the last day of school",
    ],
    "advice": [
        "starting their first job", "moving to a new city", "learning to program",
        "preparing for a long hike", "running their first marathon", "starting university",
        "working from home for the first time", "buying their first car", "adopting a rescue dog",
        "planning a wedding on a budget", "starting a small online shop", "going back to study as an adult",
        "travelling alone for the first time", "managing a team for the first time",
    ],
}

# Held-out topics for the evaluation prompts; none appears in TRAIN_TOPICS.
EVAL_TOPICS = {
    "explain": ["how tides shape coastlines over centuries", "the Krebs cycle", "how a jet engine works"],
    "email": ["asking a colleague to swap shifts next week", "thanking a mentor after a year of guidance"],
    "howto": ["repot a large houseplant", "learn to juggle three balls", "plan a family reunion"],
    "compare": [("hiking boots", "trail running shoes"), ("watercolour", "acrylic paint for beginners")],
    "ideas": ["a museum visit with children", "a library's summer reading programme", "a picnic in the park"],
    "summarise": ["four-season tyres", "homework-free weekends"],
    "write": ["a bicycle left in the rain", "a clockmaker's workshop", "a snowy train station"],
    "advice": ["learning to sail", "opening a small café"],
}

CHAT_MODIFIERS = ["", "", "", " Keep it brief.", " Use bullet points.", " Be concise and concrete."]

# Short texts written for this file, for the edit-a-text prompts (training / held-out).
REWRITE_TEMPLATES = [
    "Rewrite this text to sound more formal:\n\n{x}",
    "Fix the grammar and spelling in this text:\n\n{x}",
    "Summarise this text in one sentence:\n\n{x}",
    "Translate this text into French:\n\n{x}",
    "Make this text friendlier and shorter:\n\n{x}",
    "Turn this text into a bulleted list of the key points:\n\n{x}",
]
TRAIN_TEXTS = [
    "hey, the meeting got moved to thursday cause half the team is out, can u update the calendar thx",
    "Our shop will be closed on Monday for stocktaking. We apologise for any inconvenience and look forward to seeing you on Tuesday.",
    "i think we should of tested the app more before launch, their were alot of bugs that users found in the first week",
    "The new library opens next month. It has a children's corner, a quiet study room, free wifi and a small café on the ground floor.",
    "The river flooded twice this year, damaging roads and homes. The council plans to build higher banks and plant trees upstream to slow the water.",
    "please remember to bring your own cup to the office kitchen from now on, we're getting rid of the paper cups to cut waste",
    "The experiment showed that plants given more light grew taller, but plants given too much water grew more slowly than the others.",
    "Tickets for the concert are sold out. If you bought a ticket and can no longer go, you can return it for a full refund until Friday.",
    "me and my brother goes to the park every sunday, we plays football and then eats ice cream",
    "The software update fixes a bug that caused the app to crash on start-up and adds a dark mode that many users asked for.",
    "Remote work saves commuting time, but some people find it harder to separate work from home life and miss seeing colleagues.",
    "the delivery was late again and the box was damaged, this is the third time this month and i want to know what you will do about it",
    "Bees pollinate many of the crops we eat. Their numbers have fallen in many regions because of habitat loss, pesticides and disease.",
    "We are looking for a volunteer to help run the book sale on Saturday morning. No experience needed, just a friendly smile.",
    "The team finished the project two weeks early and under budget, thanks to careful planning and clear communication.",
    "Dont forget to water the plants while im away, the big one needs water every two days and the small ones once a week",
]
EVAL_TEXTS = [
    "the bus to the museum leaves at 9 sharp so everyone needs to be at the school gate by quarter to, bring a packed lunch",
    "The bakery on the corner now sells gluten-free bread on weekdays, and its owners hope to add vegan cakes in the spring.",
]

# Arithmetic word problems written from templates with random numbers (not from any public set).
WORD_PROBLEMS = [
    "A shop sells pencils at {a} cents each. How much do {b} pencils cost in dollars? Show your working.",
    "A train travels {a} km in {b} hours. What is its average speed? Explain step by step.",
    "A recipe for {b} people needs {a} grams of flour. How much flour is needed for {c} people? Show your reasoning.",
    "A jacket costs ${a}. It is on sale at {p}% off. What is the sale price? Explain each step.",
    "Anna saves ${b} every week. How many weeks does she need to save ${a}? Show your working.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter? Explain.",
    "A class has {a} students and {p}% of them walk to school. How many students walk to school? Show your reasoning.",
    "A tank holds {a} litres and is filled at {b} litres per minute. How long does it take to fill from empty? Explain step by step.",
]


def rewrite_candidates(texts: list[str]) -> list[dict]:
    return [
        {"id": f"chat/rewrite/{t}/{k}", "content": template.format(x=text)}
        for t, text in enumerate(texts) for k, template in enumerate(REWRITE_TEMPLATES)
    ]


def word_problem_candidates(count: int, rng: random.Random, tag: str, avoid: frozenset[str] = frozenset()) -> list[dict]:
    """`count` word problems with random numbers; one whose text is in `avoid` (the training prompts, for the
    evaluation's) has its numbers drawn again. Both sets fill the same templates, so seed 25 drew an evaluation
    prompt word for word from training. A redraw happens only on such a collision, so seeds without one (the
    shipped seed 0) give the same prompts as before."""
    out = []
    for i in range(count):
        k = i % len(WORD_PROBLEMS)
        for _ in range(1000):
            numbers = {"a": rng.randint(12, 480), "b": rng.randint(2, 11), "c": rng.randint(2, 12), "p": rng.choice([5, 10, 15, 20, 25, 30, 40, 50])}
            content = WORD_PROBLEMS[k].format(**numbers)
            if content not in avoid:
                break
        else:
            raise DDTreeError(f"--num-chat: the training prompts hold nearly every filling of word problem {k} "
                              f"({WORD_PROBLEMS[k][:40]}...), so none is left for the evaluation; ask for fewer chat prompts")
        out.append({"id": f"chat/math-{tag}/{i}/{k}", "content": content})
    return out


def chat_candidates(topics: dict, rng: random.Random) -> list[dict]:
    """All template x topic chat prompts (a random style modifier on some, chosen by rng)."""
    candidates = []
    for category in sorted(topics):
        for topic_index, topic in enumerate(topics[category]):
            for template_index, template in enumerate(CHAT_TEMPLATES[category]):
                if isinstance(topic, tuple):
                    a, b = topic
                    content = template.format(a=a, b=b, A=a[0].upper() + a[1:])
                else:
                    content = template.format(x=topic)
                content = content[0].upper() + content[1:]
                # "write" prompts have their own form; a modifier would fight it.
                if category not in ("write", "email", "summarise"):
                    content += rng.choice(CHAT_MODIFIERS)
                candidates.append({"id": f"chat/{category}/{topic_index}/{template_index}", "content": content})
    return candidates


# ----------------------------------------------------------------------------- assembly

def sample(candidates: list[dict], count: int, rng: random.Random) -> list[dict]:
    """Up to `count` candidates in random order (all of them if fewer exist)."""
    chosen = list(candidates)
    rng.shuffle(chosen)
    return chosen[:count]


def spread_sample(candidates: list[dict], count: int, rng: random.Random, group) -> list[dict]:
    """`count` candidates taking one per group in turn, so no single group dominates."""
    groups: dict[str, list[dict]] = {}
    for candidate in candidates:
        groups.setdefault(group(candidate), []).append(candidate)
    order = sorted(groups)
    for name in order:
        rng.shuffle(groups[name])
    rng.shuffle(order)
    chosen = []
    while len(chosen) < count and any(groups.values()):
        for name in order:
            if groups[name] and len(chosen) < count:
                chosen.append(groups[name].pop())
    return chosen


def to_record(candidate: dict, prefix: str) -> dict:
    return {"id": f"{prefix}{candidate['id']}", "messages": [{"role": "user", "content": candidate["content"]}]}


def build(seed: int, num_coding: int, num_chat: int, num_eval: int) -> tuple[list[dict], list[dict]]:
    """Return (train records, eval records); deterministic in the seed."""
    rng = random.Random(seed)
    # Coding: round-robin over modules, so big modules (math, ast) do not crowd out small ones.
    train_code = spread_sample(coding_candidates(TRAIN_MODULES), num_coding, rng, lambda c: c["module"])
    if len(train_code) < num_coding:  # spread_sample stops at what there is: fewer were written without a word
        raise DDTreeError(f"--num-coding {num_coding}: the {len(TRAIN_MODULES)} training modules of this Python's "
                          f"standard library make only {len(train_code)} coding prompts; ask for fewer")
    # Chat: every template x topic and edit-a-text prompt, topped up with word problems.
    chat = chat_candidates(TRAIN_TOPICS, rng) + rewrite_candidates(TRAIN_TEXTS)
    chat += word_problem_candidates(max(0, num_chat - len(chat)), rng, "train")
    train_chat = sample(chat, num_chat, rng)
    train = [to_record(c, "") for c in train_code + train_chat]
    rng.shuffle(train)  # so any prefix (e.g. --limit in regeneration) is a mix of both kinds

    # Eval: half coding (spread over the held-out modules), half chat (spread over categories).
    eval_code = spread_sample(coding_candidates(EVAL_MODULES), num_eval // 2, rng, lambda c: c["module"])
    train_texts = frozenset(r["messages"][0]["content"] for r in train)
    eval_chat = (chat_candidates(EVAL_TOPICS, rng) + rewrite_candidates(EVAL_TEXTS)
                 + word_problem_candidates(4, rng, "eval", avoid=train_texts))
    eval_chat = spread_sample(eval_chat, num_eval - num_eval // 2, rng, lambda c: c["id"].split("/")[1])
    # Alternated, so that any prefix (the in-training evaluation's eval.limit) is half coding, half chat.
    evaluation = [to_record(c, "eval-") for pair in zip(eval_code, eval_chat) for c in pair]
    paired = min(len(eval_code), len(eval_chat))
    evaluation += [to_record(c, "eval-") for c in eval_chat[paired:] + eval_code[paired:]]  # an odd count: the last is chat
    if len(evaluation) < num_eval:  # zip dropped the coding prompts past the chat ones, without a word
        raise DDTreeError(f"--num-eval {num_eval}: the held-out modules and topics make only {len(eval_code)} coding "
                          f"and {len(eval_chat)} chat prompts for it ({len(evaluation)} in all); ask for fewer")

    # The promise of the docstring, kept under `python -O` too (an assert there wrote the leak without a word).
    if set(TRAIN_MODULES) & set(EVAL_MODULES):
        raise DDTreeError(f"make_prompts.py: {sorted(set(TRAIN_MODULES) & set(EVAL_MODULES))} are in both TRAIN_MODULES "
                          "and EVAL_MODULES; keep each module in one list")
    overlap = [r["id"] for r in evaluation if r["messages"][0]["content"] in train_texts]
    if overlap:
        raise DDTreeError(f"--seed {seed}: the evaluation prompts {overlap} are also training prompts; try another --seed")
    return train, evaluation


def jsonl_text(records: list[dict]) -> str:
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def write_jsonl(records: list[dict], path: Path) -> None:
    """One JSON object per line, written atomically (a reader never sees half a file)."""
    with atomic_file(path) as handle:
        handle.write(jsonl_text(records))


def check_replaceable(path: Path, records: list[dict], flag: str, overwrite: bool) -> None:
    """The defaults are the shipped files: rewriting them with other settings (or another Python's stdlib) would
    change the repository's prompts without a word. A file that already holds exactly these records is fine; one in
    another encoding (its undecodable bytes replaced) reads as other prompts, not as a UnicodeDecodeError traceback."""
    if overwrite or not path.exists() or (path.is_file() and
                                          path.read_text(encoding="utf-8", errors="replace") == jsonl_text(records)):
        return
    python = ""
    if path.resolve() in SHIPPED_FILES and sys.version_info[:2] != SHIPPED_PYTHON:
        shipped, this = ".".join(map(str, SHIPPED_PYTHON)), ".".join(map(str, sys.version_info[:2]))
        python = (f" (the shipped files were written with Python {shipped}, whose standard library gives other coding "
                  f"prompts than this Python {this}'s: run it with {shipped} to write them again)")
    raise DDTreeError(f"{flag} {path} exists and holds other prompts than these settings make{python}; pass "
                      "--overwrite to replace it, or give another path")


@command
def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-coding", type=int, default=2400, help="training coding prompts")
    parser.add_argument("--num-chat", type=int, default=1600, help="training chat prompts")
    parser.add_argument("--num-eval", type=int, default=40, help="evaluation prompts (half coding, half chat)")
    parser.add_argument("--train-out", type=path_type, default=Path("data/prompts/train_prompts.jsonl"))
    parser.add_argument("--eval-out", type=path_type, default=Path("data/eval_prompts.jsonl"))
    parser.add_argument("--overwrite", action="store_true", help="replace output files that hold other prompts")
    args = parser.parse_args(argv)
    for flag, count, least in (("--num-coding", args.num_coding, 0), ("--num-chat", args.num_chat, 0),
                               ("--num-eval", args.num_eval, 1)):
        if count < least:
            raise DDTreeError(f"{flag} {count}: give a count of at least {least}")
    if args.num_coding + args.num_chat < 1:
        raise DDTreeError("--num-coding 0 --num-chat 0: no training prompts to write; give at least one")
    if args.train_out.resolve() == args.eval_out.resolve():
        raise DDTreeError(f"--train-out and --eval-out are both {args.train_out}: the evaluation prompts would replace "
                          "the training prompts; give two paths")
    for flag, path in (("--train-out", args.train_out), ("--eval-out", args.eval_out)):
        # Before the work: a folder was refused as "other prompts" and, with --overwrite, failed at its rename.
        if path.is_dir():
            raise DDTreeError(f"{flag} {path} is a folder; give the path of the JSONL file to write "
                              f"({path / 'prompts.jsonl'}, say)")
        check_output_file(path, flag)  # a path under a file, or in a folder this user cannot write

    train, evaluation = build(args.seed, args.num_coding, args.num_chat, args.num_eval)
    check_replaceable(args.train_out, train, "--train-out", args.overwrite)
    check_replaceable(args.eval_out, evaluation, "--eval-out", args.overwrite)
    write_jsonl(train, args.train_out)
    write_jsonl(evaluation, args.eval_out)
    num_code = sum(r["id"].startswith("code/") for r in train)
    print(f"wrote {len(train)} training prompts ({num_code} coding, {len(train) - num_code} chat) to {args.train_out}")
    print(f"wrote {len(evaluation)} evaluation prompts to {args.eval_out} (python {sys.version.split()[0]}, seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
