"""Procedural training corpus for the bundled model: short stories, friendly chat turns, and addition.

No data set can be downloaded here, and the model is tiny, so the corpus is generated from a grammar:
every document is a pure function of a `random.Random` seeded by the caller (deterministic training).

- Stories: a cast (name + kind + trait), a place, a wanted object, an event (problem), a helper, an
  attempt and an ending, each picked from lists and rendered through several sentence templates.
- Chat: the 2B-4T chat form (`System: ...<|eot_id|>User: ...<|eot_id|>Assistant: ...<|eot_id|>`) with
  greetings, "who are you", how-are-you, thanks, goodbyes, story requests and addition questions.
- Bare addition: "23+45=68" (every digit is its own token, see train.py's tokenizer).

`WORDS` is the set of every word the grammar can produce (tests check generated text against it).
"""
from __future__ import annotations

import random
import re

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"

NAMES = ["Pip", "Mia", "Tom", "Lily", "Ben", "Sara", "Max", "Anna", "Leo", "Nora", "Sam", "Ella", "Jack",
         "Rosa", "Finn", "Ivy", "Oscar", "Ruby", "Hugo", "Daisy", "Milo", "Luna", "Otto", "Zoe", "Theo",
         "Maya", "Felix", "Clara", "Jonas", "Greta"]
KINDS = ["girl", "boy", "fox", "rabbit", "bear", "cat", "dog", "mouse", "owl", "duck", "frog", "turtle",
         "squirrel", "robot", "dragon", "bird", "pig", "goat", "lamb", "hedgehog"]
TRAITS = ["little", "brave", "curious", "kind", "shy", "happy", "clever", "tiny", "gentle", "funny",
          "quiet", "busy", "sleepy", "friendly", "careful", "bold", "young", "silly", "proud", "cheerful"]
PLACES = ["the forest", "the park", "the garden", "the beach", "a small village", "the farm", "the hill",
          "the meadow", "the river", "the old town", "the school", "the lake", "the market", "the castle",
          "the big city", "the mountain", "the library", "the zoo", "the field", "the harbor"]
WEATHER = ["the sun was shining", "it was a cold morning", "the wind was soft", "it was raining a little",
           "the sky was blue", "snow was falling", "the air was warm", "the clouds were grey",
           "the stars were bright", "it was a quiet evening"]
OBJECTS = ["a red ball", "a shiny key", "a blue kite", "a small box", "a golden coin", "a warm hat",
           "a big apple", "a old map", "a toy boat", "a yellow flower", "a magic stone", "a green book",
           "a little bell", "a wooden spoon", "a soft blanket", "a paper star", "a silver ring",
           "a bag of seeds", "a broken clock", "a long rope"]
FEELINGS = ["happy", "sad", "scared", "excited", "worried", "surprised", "tired", "proud", "angry",
            "lonely", "calm", "glad"]
FRIENDS = ["a wise old owl", "a friendly dog", "a tall giraffe", "a kind farmer", "a little bird",
           "an old turtle", "a busy bee", "a gentle horse", "a small mouse", "a happy frog",
           "a clever cat", "a big bear", "a young girl", "a tall man", "a kind teacher"]
PROBLEMS = [
    ("lost {obj}", "could not find {obj}"),
    ("dropped {obj} into the water", "saw {obj} sink into the water"),
    ("saw {obj} stuck in a tree", "could not reach {obj} in the tree"),
    ("found {obj} under a rock", "wanted to know who owned {obj}"),
    ("wanted to give {obj} to a friend", "did not know where the friend was"),
    ("heard a strange noise", "was afraid to look"),
    ("got lost on the way home", "did not know which way to go"),
    ("wanted to build a house", "did not have enough wood"),
    ("wanted to win the race", "was not very fast"),
    ("wanted to bake a cake", "had no eggs"),
]
ATTEMPTS = [
    "{name} looked everywhere, under the bed, behind the door and in the grass.",
    "{name} tried again and again, but it was very hard.",
    "{name} asked {friend} for help.",
    "{name} sat down and thought for a long time.",
    "{name} climbed up high to see better.",
    "{name} walked all the way to {place2} to look for help.",
    "{name} called out, but nobody answered.",
    "{name} took a deep breath and tried one more time.",
]
HELPS = [
    "{Friend} said, \"Do not worry. I will help you.\"",
    "{Friend} came by and smiled.",
    "Then {friend} had a good idea.",
    "Just then, {friend} walked by and saw what was wrong.",
    "{Friend} listened and said, \"Let us do it together.\"",
]
ENDINGS = [
    "At last {name} {solved}. {Pron} felt very {good}.",
    "In the end, {name} {solved}, and they laughed together.",
    "Soon {name} {solved}. It was the best day ever.",
    "Together they worked hard, and {name} {solved}. {Pron} said thank you to {friend}.",
    "After a while, {name} {solved}. {Pron} went home with a big smile.",
]
SOLVED = ["found it again", "fixed the problem", "got it back", "made it work", "found the way",
          "learned something new", "did it", "finished the job"]
MORALS = [
    "{Name} learned that friends help each other.",
    "From that day on, {name} was never afraid to ask for help.",
    "{Name} knew that trying again is the way to win.",
    "And {name} always remembered that day.",
    "That night, {name} slept well and dreamed of {place}.",
    "The next day, {name} told everyone the story.",
]
OPENINGS = [
    "Once upon a time, there was a {trait} {kind} named {name}.",
    "One day, a {trait} {kind} named {name} went to {place}.",
    "There once was a {trait} {kind} called {name} who lived near {place}.",
    "Long ago, in {place}, lived a {trait} {kind} named {name}.",
    "{Name} was a {trait} {kind}.",
]
SETTINGS = [
    "One morning, {weather}, and {name} went out to play in {place}.",
    "{Name} liked to walk in {place} every day.",
    "It was a nice day and {weather}.",
    "{Pron} loved {place} because it was full of things to see.",
    "{Name} had {obj2}, and {pron} took it everywhere.",
]

SYSTEMS = ["You are a helpful AI assistant.", "You are a friendly assistant.", "You are a helpful assistant.",
           "You are a small and kind AI model."]
GREETINGS_USER = ["Hi!", "Hello!", "Hello", "Hi", "Hey!", "Hey there!", "Good morning!", "Good evening!",
                  "Hi there!", "Hello, how are you?", "Hey, how are you?", "Hi, how are you doing?"]
GREETINGS_BOT = ["Hello! How can I help you today?", "Hi there! What can I do for you?",
                 "Hello! It is nice to meet you. How can I help?", "Hi! I am happy to chat with you.",
                 "Hello! I am here to help. Ask me a question or ask for a story."]
HOWARE_USER = ["How are you?", "How are you doing?", "How is your day?", "Are you okay?"]
HOWARE_BOT = ["I am doing well, thank you! How can I help you?", "I am fine, thank you for asking! How are you?",
              "I am great, thanks! What would you like to talk about?"]
WHO_USER = ["Who are you?", "What are you?", "What is your name?", "Tell me about yourself.",
            "Are you a robot?", "Who made you?", "What kind of model are you?"]
WHO_BOT = ["I am a small BitNet model made by the bitnet-cpu project. My weights are only -1, 0 or 1, so I can "
           "run fast on a CPU. I can tell short stories and add numbers.",
           "I am a tiny BitNet b1.58 language model, trained by the bitnet-cpu project. I can chat a little, "
           "tell short stories and add two numbers.",
           "My name is BitNet. I am a small model with ternary weights, made by the bitnet-cpu project."]
CAN_USER = ["What can you do?", "How can you help me?", "What are you good at?"]
CAN_BOT = ["I can tell you a short story, add two numbers like 23+45, and say hello. Just ask!",
           "I am good at short stories and at adding numbers. Try asking me: What is 12+34?"]
THANKS_USER = ["Thank you!", "Thanks!", "Thanks a lot.", "Thank you very much.", "Great, thanks!", "Nice!"]
THANKS_BOT = ["You are welcome!", "You are welcome! Is there anything else I can do?", "Happy to help!",
              "Any time! Have a nice day."]
BYE_USER = ["Bye!", "Goodbye!", "See you later!", "Good night!", "Bye, see you."]
BYE_BOT = ["Goodbye! Have a nice day.", "Bye! It was nice to talk with you.", "See you later! Take care.",
           "Good night! Sleep well."]
STORY_USER = ["Tell me a story.", "Can you tell me a story?", "Please tell me a short story.",
              "I want a story.", "Tell me a story about a {kind}."]
STORY_BOT_INTRO = ["Sure! Here is a story.", "Of course!", "Here is a short story.", ""]
ADD_USER = ["What is {a}+{b}?", "What is {a} + {b}?", "How much is {a}+{b}?", "Can you add {a} and {b}?",
            "{a}+{b}=?", "Please compute {a}+{b}.", "What is the sum of {a} and {b}?", "Add {a} and {b}.",
            "{a}+{b}"]
# Phase 8: the ways people type a sum first, lower case and without punctuation too. The four a
# newcomer tries ("2+3", "what's 2 plus 3", "What is 2 + 3?", "add 2 and 3") appear twice. The answer
# restates the numbers as the user wrote them: "12+30=42." (never "1+30=31.").
ADD_USER_TYPED = ADD_USER + [
    "{a}+{b}", "{a} + {b}", "{a}+{b}=", "{a}+{b}?", "{a} + {b} =", "{a} plus {b}", "what's {a} plus {b}",
    "what's {a} plus {b}", "What's {a} plus {b}?", "what's {a}+{b}", "What's {a} + {b}?", "whats {a} plus {b}",
    "what is {a} plus {b}", "What is {a} plus {b}?", "what is {a}+{b}", "what is {a} + {b}", "What is {a}+{b}",
    "What is {a} + {b}?", "add {a} and {b}", "add {a} and {b}", "Add {a} and {b}", "add {a} and {b}.",
    "Add {a} and {b}, please.", "add {a} plus {b}"]


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def story(rng: random.Random, kind: str | None = None) -> str:
    """One short story (about 60-140 words)."""
    name, trait = rng.choice(NAMES), rng.choice(TRAITS)
    kind = kind or rng.choice(KINDS)
    pron = rng.choice(["he", "she"]) if kind not in ("girl", "boy") else ("she" if kind == "girl" else "he")
    place, place2 = rng.sample(PLACES, 2)
    obj, obj2 = rng.sample(OBJECTS, 2)
    friend = rng.choice(FRIENDS)
    prob, hard = rng.choice(PROBLEMS)
    v = dict(name=name, Name=name, trait=trait, kind=kind, place=place, place2=place2, obj=obj, obj2=obj2,
             friend=friend, Friend=_cap(friend), pron=pron, Pron=_cap(pron), weather=rng.choice(WEATHER),
             solved=rng.choice(SOLVED), good=rng.choice(["happy", "proud", "glad", "calm"]))
    out = [rng.choice(OPENINGS)]
    out += rng.sample(SETTINGS, rng.randint(1, 2))
    out.append("One day, {name} " + prob + ".")
    out.append("{Pron} was " + rng.choice(FEELINGS) + " because {pron} " + hard + ".")
    out += rng.sample(ATTEMPTS, rng.randint(1, 2))
    out.append(rng.choice(HELPS))
    out.append(rng.choice(ENDINGS))
    if rng.random() < 0.7:
        out.append(rng.choice(MORALS))
    text = " ".join(out)
    for _ in range(2):  # fields may contain fields ({obj} inside a problem)
        text = text.format(**v)
    return text.replace("a old", "an old")


def add_answer(a: int, b: int) -> str:
    return f"{a}+{b}={a + b}"


def add_question(rng: random.Random, a: int, b: int, forms=ADD_USER) -> str:
    return rng.choice(forms).format(a=a, b=b)


def chat_turn(rng: random.Random, pairs, forms=ADD_USER, p_add: float = 0.45) -> tuple[str, str]:
    """One (user, assistant) exchange; addition operands come from `pairs` (the training split).
    An addition question with probability `p_add`, phrased by one of `forms`; the other turns keep their
    relative frequencies (the defaults are phases 1-7's corpus, unchanged)."""
    r = rng.random()
    if r < p_add:
        a, b = pairs[rng.randrange(len(pairs))]
        return add_question(rng, a, b, forms), add_answer(a, b) + "."
    if p_add != 0.45:   # map the rest onto the default layout of the other turns
        r = 0.45 + (r - p_add) * 0.55 / (1.0 - p_add)
    for cut, users, bots in ((0.55, GREETINGS_USER, GREETINGS_BOT), (0.65, WHO_USER, WHO_BOT),
                             (0.70, HOWARE_USER, HOWARE_BOT), (0.75, CAN_USER, CAN_BOT),
                             (0.82, THANKS_USER, THANKS_BOT), (0.87, BYE_USER, BYE_BOT)):
        if r < cut:
            return rng.choice(users), rng.choice(bots)
    kind = rng.choice(KINDS)
    intro = rng.choice(STORY_BOT_INTRO)
    body = story(rng, kind)
    return rng.choice(STORY_USER).format(kind=kind), (intro + " " + body).strip()


def render_chat(messages: list[tuple[str, str]], system: str | None) -> str:
    """The 2B-4T chat form, exactly what tokenizer_config.json's chat_template renders (+ the answers)."""
    s = BOS
    if system:
        s += f"System: {system}{EOT}"
    for role, content in messages:
        s += f"{role}: {content}{EOT}"
    return s


def chat_doc(rng: random.Random, pairs, forms=ADD_USER, p_add: float = 0.45) -> str:
    system = rng.choice(SYSTEMS) if rng.random() < 0.6 else None
    msgs = []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        u, a = chat_turn(rng, pairs, forms, p_add)
        msgs += [("User", u), ("Assistant", a)]
    return render_chat(msgs, system)


def bare_add_doc(rng: random.Random, pairs) -> str:
    a, b = pairs[rng.randrange(len(pairs))]
    pre = BOS if rng.random() < 0.85 else ""   # prompts may come without BOS
    return pre + add_answer(a, b) + EOS


def story_doc(rng: random.Random) -> str:
    pre = BOS if rng.random() < 0.9 else ""
    return pre + story(rng) + EOS


def split_pairs(seed: int, n_heldout: int = 200):
    """All 10,000 (a, b) pairs with 0 <= a, b <= 99, split into (train, heldout) deterministically."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    rng = random.Random(seed * 7919 + 17)
    rng.shuffle(pairs)
    return pairs[n_heldout:], pairs[:n_heldout]


def _grammar_words() -> set[str]:
    lists = [NAMES, KINDS, TRAITS, PLACES, WEATHER, OBJECTS, FEELINGS, FRIENDS, ATTEMPTS, HELPS, ENDINGS,
             SOLVED, MORALS, OPENINGS, SETTINGS, SYSTEMS, GREETINGS_BOT, HOWARE_BOT, WHO_BOT, CAN_BOT,
             THANKS_BOT, BYE_BOT, STORY_BOT_INTRO, [p for pair in PROBLEMS for p in pair],
             GREETINGS_USER, HOWARE_USER, WHO_USER, CAN_USER, THANKS_USER, BYE_USER, STORY_USER, ADD_USER_TYPED,
             ["one", "day", "was", "because", "he", "she", "an", "happy", "proud", "glad", "calm"]]
    words = set()
    for lst in lists:
        for s in lst:
            words.update(w.lower() for w in re.findall(r"[A-Za-z]+", re.sub(r"\{\w+\}", " ", s)))
    return words


WORDS = frozenset(_grammar_words())


# ---- evaluation task files in llama.cpp's layouts, made from the stories (bitnet perplexity --hellaswag /
# --winogrande: its tests and bench/bench_perplexity.py) ------------------------------------------------------
def hellaswag_text(n_tasks: int, seed: int = 5) -> str:
    """llama.cpp's HellaSwag file (6 lines a task: context, the gold ending's index, 4 endings): a story's opening,
    its next sentence among three sentences of other stories."""
    rng = random.Random(seed)
    sents = [re.split(r"(?<=\.) ", story(rng)) for _ in range(2 * n_tasks)]
    lines = []
    for i in range(n_tasks):
        k = rng.randrange(1, len(sents[i]) - 1)
        others = [rng.choice(sents[n_tasks + rng.randrange(n_tasks)]) for _ in range(3)]
        gold = rng.randrange(4)
        lines += ["Story: " + " ".join(sents[i][:k]), str(gold)] + others[:gold] + [sents[i][k]] + others[gold:]
    return "\n".join(lines) + "\n"


def winogrande_text(n_rows: int, seed: int = 9) -> str:
    """llama.cpp's Winogrande CSV (a header, then index,sentence,choice1,choice2,answer) with n_rows task rows: a
    story's opening with its hero's last mention as "_" (quoted: it holds commas), the hero and another story's
    hero as the choices."""
    rng = random.Random(seed)
    stories = [story(rng) for _ in range(3 * n_rows)]
    names = sorted({m.group(1) for s in stories for m in [re.search(r"named (\w+)", s)] if m})
    rows = ["index,sentence,option1,option2,answer"]
    for s in stories:
        m = re.search(r"named (\w+)", s)
        seg = " ".join(re.split(r"(?<=\.) ", s)[:4])
        k = seg.rfind(m.group(1)) if m else -1
        if m is None or k <= m.end():
            continue
        other = rng.choice([n for n in names if n != m.group(1)])
        answer = rng.randrange(1, 3)
        options = (m.group(1), other) if answer == 1 else (other, m.group(1))
        rows.append(f'{len(rows) - 1},"{seg[:k]}_{seg[k + len(m.group(1)):]}",{options[0]},{options[1]},{answer}')
        if len(rows) == n_rows + 1:
            break
    return "\n".join(rows) + "\n"


def multiple_choice_bytes(n_tasks: int, seed: int = 11) -> bytes:
    """llama.cpp's binary multiple-choice file (uint32 count, uint32 offsets, then per task: the question, mc1 and
    mc2 answer sets as uint32 count, length-prefixed UTF-8 strings, int32 labels; little-endian): a story's opening
    as the question, its next sentence among 1-4 sentences of other stories (2-5 answers), label 1 on it; mc2 holds
    the same answers with two labels set (llama-perplexity reads it and scores mc1 only)."""
    import struct

    rng = random.Random(seed)
    sents = [re.split(r"(?<=\.) ", story(rng)) for _ in range(2 * n_tasks)]

    def text(t: str) -> bytes:
        b = t.encode("utf-8")
        return struct.pack("<I", len(b)) + b

    def answer_set(answers: list[str], labels: list[int]) -> bytes:
        return (struct.pack("<I", len(answers)) + b"".join(map(text, answers)) +
                struct.pack(f"<{len(labels)}i", *labels))

    blobs = []
    for i in range(n_tasks):
        k = rng.randrange(1, len(sents[i]) - 1)
        answers = [rng.choice(sents[n_tasks + rng.randrange(n_tasks)]) for _ in range(rng.randrange(1, 5))]
        right = rng.randrange(len(answers) + 1)
        answers.insert(right, sents[i][k])
        labels = [int(j == right) for j in range(len(answers))]
        mc2 = [int(j == right or j == 0) for j in range(len(answers))]
        blobs.append(text(" ".join(sents[i][:k])) + answer_set(answers, labels) + answer_set(answers, mc2))
    offsets, pos = [], 4 + 4 * n_tasks
    for b in blobs:
        offsets.append(pos)
        pos += len(b)
    return struct.pack(f"<I{n_tasks}I", n_tasks, *offsets) + b"".join(blobs)
