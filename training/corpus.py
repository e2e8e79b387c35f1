"""A seeded generator of chat-form training data: children's stories from a small grammar.

The bundled default model is trained on this corpus only. The grammar is rich
enough that the answers read like real (short) stories, and small enough that a
4-million-parameter model learns it on two CPU cores in a few minutes:

* a **user** asks for a story about an animal with a name (often an adjective,
  sometimes a place), in one of many phrasings;
* the **assistant** answers with a 3-6 sentence story that uses the requested
  name, animal, adjective and place consistently, then stops;
* most conversations start with one of a few LONG **system prompts** (each spans
  many 16-token KV-cache blocks), which is what makes prefix caching visible in
  the course: every request that shares a system prompt shares its blocks;
* some conversations have two turns (a second request after the first story), so
  multi-turn chat -- and the prefix it re-sends -- works too.

The system prompts are not decoration: two of them ask for a closing line
("The end." / a good-night wish) and the stories under them follow it, so the
model must attend back over the whole system prompt.

Everything is drawn from ``random.Random(seed)``: the same seed gives the same
corpus, byte for byte.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# --------------------------------------------------------------------------- #
# Vocabulary of the story world
# --------------------------------------------------------------------------- #

# Each name has a fixed pronoun so the stories stay consistent ("Leo ... he").
NAMES: dict[str, str] = {
    "Leo": "he",
    "Max": "he",
    "Sam": "he",
    "Finn": "he",
    "Oscar": "he",
    "Toby": "he",
    "Jack": "he",
    "Theo": "he",
    "Milo": "he",
    "Ben": "he",
    "Hugo": "he",
    "Felix": "he",
    "Otto": "he",
    "Arlo": "he",
    "Noah": "he",
    "Mia": "she",
    "Luna": "she",
    "Ruby": "she",
    "Ella": "she",
    "Lily": "she",
    "Rosa": "she",
    "Nora": "she",
    "Zoe": "she",
    "Ivy": "she",
    "Daisy": "she",
    "Maya": "she",
    "Hazel": "she",
    "Clara": "she",
    "Willow": "she",
    "Ada": "she",
}
POSSESSIVE = {"he": "his", "she": "her"}

ANIMALS = [
    "dog",
    "cat",
    "fox",
    "rabbit",
    "bear",
    "owl",
    "mouse",
    "duck",
    "horse",
    "lion",
    "turtle",
    "frog",
    "pig",
    "goat",
    "deer",
    "squirrel",
    "hedgehog",
    "penguin",
    "elephant",
    "tiger",
]

# adjective -> sentences that show the trait (so the adjective is *used*, not just named).
ADJECTIVES: dict[str, list[str]] = {
    "brave": ["{Name} was never afraid, not even of the dark.", "{Pron} always stood up for {pos} friends."],
    "kind": ["{Name} always shared {pos} food with everyone.", "{Pron} liked to help anyone who was sad."],
    "curious": [
        "{Name} loved to ask questions about everything.",
        "{Pron} always wanted to know what was behind the next hill.",
    ],
    "shy": [
        "{Name} spoke very softly and liked to play alone.",
        "{Pron} often hid behind {pos} mother when visitors came.",
    ],
    "clever": [
        "{Name} could solve any puzzle in a few minutes.",
        "{Pron} always had a good idea when something went wrong.",
    ],
    "happy": ["{Name} sang a little song every morning.", "{Pron} smiled at everyone {pron_lower} met."],
    "gentle": [
        "{Name} never hurt even the smallest bug.",
        "{Pron} always walked softly so the flowers would not break.",
    ],
    "silly": ["{Name} loved to make funny faces.", "{Pron} once wore a bucket as a hat for a whole day."],
    "sleepy": ["{Name} could take a nap almost anywhere.", "{Pron} yawned so much that {pos} friends yawned too."],
    "little": [
        "{Name} was smaller than all the other animals.",
        "{Pron} had to stand on a stone to see over the grass.",
    ],
    "friendly": ["{Name} said hello to every animal {pron_lower} met.", "{Pron} had more friends than anyone else."],
    "playful": ["{Name} loved to run, jump and chase butterflies.", "{Pron} turned every walk into a game."],
    "grumpy": ["{Name} did not like noise in the morning.", "{Pron} frowned a lot, but {pos} heart was warm."],
    "lazy": [
        "{Name} liked to lie in the sun all afternoon.",
        "{Pron} always said that tomorrow was a good day for work.",
    ],
}

# place noun -> how a story says where someone lives.
PLACES: dict[str, str] = {
    "forest": "in a green forest",
    "farm": "on a big farm",
    "river": "by a wide river",
    "meadow": "in a sunny meadow",
    "garden": "in a quiet garden",
    "village": "in a small village",
    "beach": "near a sandy beach",
    "hill": "on a windy hill",
    "pond": "next to a little pond",
    "mountain": "on a snowy mountain",
    "jungle": "in a thick jungle",
    "lake": "by a calm lake",
}
# ... and when the story comes back to it ("everyone in the forest knew ...")
PLACES_THE: dict[str, str] = {
    "forest": "in the forest",
    "farm": "on the farm",
    "river": "by the river",
    "meadow": "in the meadow",
    "garden": "in the garden",
    "village": "in the village",
    "beach": "at the beach",
    "hill": "on the hill",
    "pond": "at the pond",
    "mountain": "on the mountain",
    "jungle": "in the jungle",
    "lake": "by the lake",
}
# the same places as a user might say them: "who lives in the forest"
USER_PLACES: dict[str, str] = {
    "forest": "in the forest",
    "farm": "on a farm",
    "river": "by the river",
    "meadow": "in a meadow",
    "garden": "in a garden",
    "village": "in a village",
    "beach": "near the beach",
    "hill": "on a hill",
    "pond": "by a pond",
    "mountain": "on a mountain",
    "jungle": "in the jungle",
    "lake": "by a lake",
}

OBJECTS = [
    "a shiny red ball",
    "a golden key",
    "an old map",
    "a blue feather",
    "a tiny silver bell",
    "a big green apple",
    "a lost kite",
    "a wooden box",
]
SPOTS = [
    "under a tall tree",
    "behind a big rock",
    "near the old bridge",
    "in the long grass",
    "next to the path",
    "under a pile of leaves",
]
LANDMARKS = ["old bridge", "tall tree", "big rock", "little stream", "red barn", "stone wall"]


def article(word: str) -> str:
    """``a`` or ``an`` for the word that follows (enough English for this grammar)."""
    return "an" if word[0].lower() in "aeiou" else "a"


def with_article(phrase: str) -> str:
    return f"{article(phrase)} {phrase}"


# --------------------------------------------------------------------------- #
# System prompts: long, fixed, shared by many conversations
# --------------------------------------------------------------------------- #

_ANIMAL_LIST = ", ".join(ANIMALS)
_PLACE_LIST = ", ".join(PLACES)

SYSTEM_PROMPTS: list[str] = [
    # 0: the plain storyteller
    "You are Pip, a friendly storyteller for young children. Parents and teachers "
    "ask you for short bedtime stories, and you answer with one story at a time.\n\n"
    "Style rules:\n"
    "1. Write three to six short sentences. Young children lose interest in long stories.\n"
    "2. Use simple words that a five-year-old can understand.\n"
    "3. Always use the name, the animal and the kind of character the user asks for, "
    "and keep them the same from the first sentence to the last.\n"
    "4. Every story has a small adventure and a happy ending.\n"
    "5. Do not ask questions back. Just tell the story.\n\n"
    "House rules:\n"
    "- Nobody gets hurt, and nothing scary happens at night.\n"
    "- Friends help each other, and problems are solved by being kind or clever.\n"
    "- Do not use brand names, real people or places from the news.\n\n"
    f"Allowed animals: {_ANIMAL_LIST}.\n"
    f"Allowed places: {_PLACE_LIST}.\n"
    "If the user asks for an animal that is not on the list, pick the closest one from the list.",
    # 1: the library storyteller, ends with "The end."
    "You are the storyteller of the Little Acorn Library. Every evening, children come "
    "to the reading corner and ask for a story about an animal friend. Your job is to "
    "answer each request with one short, warm story.\n\n"
    "How to write a story:\n"
    "- Begin by introducing the main character: the animal, its name and what it is like.\n"
    "- Say where the character lives if the child mentions a place, or choose a nice one.\n"
    "- Then tell one small event: finding something, helping a friend, a rainy day, a walk.\n"
    "- Finish with a calm, happy ending.\n"
    "- Keep it between three and six sentences.\n\n"
    'Important library rule: always finish the story with the words "The end." on the '
    "same line, so the children know the story is over and it is time for the next one.\n\n"
    "Things to avoid: monsters, fights, sad endings, long words and long sentences. "
    "Never change the name or the animal the child asked for.\n\n"
    f"Animals that live in our stories: {_ANIMAL_LIST}.\n"
    f"Places in our story world: {_PLACE_LIST}.",
    # 2: a terse, rule-list system prompt
    "SYSTEM CONFIGURATION FOR THE STORY ASSISTANT\n"
    "Role: children's story generator.\n"
    "Audience: children aged three to seven and the adults who read to them.\n"
    "Output format: one paragraph of plain text, three to six sentences, no title, "
    "no lists, no questions to the user.\n"
    "Content policy: gentle, friendly, safe. No danger, no villains, no sadness at the end.\n"
    "Consistency policy: the main character keeps the exact name and species given in the "
    "request for the whole story. If the request gives a trait such as brave, kind or shy, "
    "the story shows that trait. If the request gives a place, the story happens there.\n"
    "Length policy: short. Stop after the ending sentence.\n"
    f"Known species: {_ANIMAL_LIST}.\n"
    f"Known settings: {_PLACE_LIST}.\n"
    "Known traits: " + ", ".join(ADJECTIVES) + ".\n"
    "Version: 2.3. This configuration applies to every conversation in this session.",
    # 3: the grandmother persona, ends with a good-night wish
    "You are Grandma Rose, a gentle grandmother who tells bedtime stories to her "
    "grandchildren. You speak slowly and warmly, and you love animals of every kind.\n\n"
    "When a grandchild asks for a story, tell a short one about the animal they want, "
    "with the name they choose. Keep it to a few sentences: it is late, and little eyes "
    "are getting heavy. Let the story have one small adventure, and let everything turn "
    "out well in the end.\n\n"
    "Because these are bedtime stories, always close with the sentence "
    '"Good night, sleep tight." after the story.\n\n'
    "Remember your rules: no scary parts, no sad parts, simple words, and always the same "
    "name and animal from the beginning to the end. The animals you know stories about are "
    f"the {_ANIMAL_LIST}. The places you like to describe are the {_PLACE_LIST}.\n\n"
    "Your grandchildren are allowed one story each before they sleep, and sometimes they "
    "beg for a second one. If they do, you may tell one more.",
    # 4: the classroom assistant
    "You are a helpful assistant for a kindergarten classroom. The teacher uses you to "
    "create short stories that she reads aloud during circle time. The children choose "
    "an animal, a name and sometimes a word that describes the animal, and you write the "
    "story on the spot.\n\n"
    "Guidelines for every story:\n"
    "* The story is three to six sentences long and fits on one small card.\n"
    "* The main character is the animal the children chose, with the name they chose.\n"
    "* If they chose a describing word, such as curious, silly or gentle, show it in the story.\n"
    "* Something small happens: a found object, a friend in need, a change in the weather, "
    "a climb or a walk, and it ends well.\n"
    "* Use words the children know. Avoid anything frightening.\n\n"
    "The class has learned about these animals this year: "
    f"{_ANIMAL_LIST}. They have also learned about these places: {_PLACE_LIST}. "
    "Choose from these when the children do not say where the story happens.\n\n"
    "Thank you for helping the children love stories.",
]

# The closing line each system prompt asks for ("" = none).
SYSTEM_ENDINGS: list[str] = ["", "The end.", "", "Good night, sleep tight.", ""]


# --------------------------------------------------------------------------- #
# Requests and stories
# --------------------------------------------------------------------------- #


@dataclass
class StorySpec:
    """What the user asked for; ``adjective`` and ``place`` may be None (the story picks)."""

    name: str
    animal: str
    adjective: str | None = None
    place: str | None = None


def random_spec(rng: random.Random) -> StorySpec:
    return StorySpec(
        name=rng.choice(list(NAMES)),
        animal=rng.choice(ANIMALS),
        adjective=rng.choice(list(ADJECTIVES)) if rng.random() < 0.8 else None,
        place=rng.choice(list(PLACES)) if rng.random() < 0.35 else None,
    )


def user_request(spec: StorySpec, rng: random.Random, follow_up: bool = False) -> str:
    """One phrasing of "tell me a story about ..." for ``spec``."""
    n, an = spec.name, spec.animal
    # the character: "a brave dog" or "a dog"
    char = with_article(f"{spec.adjective} {an}" if spec.adjective else an)
    where = f" who lives {USER_PLACES[spec.place]}" if spec.place else ""
    templates = [
        f"Tell me a story about {char} named {n}{where}.",
        f"Can you tell me a story about {char} called {n}{where}?",
        f"Please write a short story about {char} named {n}{where}.",
        f"I would like a bedtime story about {char} named {n}{where}.",
        f"Write a story about {char} called {n}{where}.",
        f"Story time! Tell me about {char} named {n}{where}.",
    ]
    if spec.adjective:
        templates.append(f"Tell me a story about {n} the {spec.adjective} {an}{where}.")
    else:
        templates.append(f"Tell me a story about {n} the {an}{where}.")
    text = rng.choice(templates)
    if follow_up:
        lead = rng.choice(
            ["Another one, please! ", "That was lovely. ", "Thank you! Now ", "One more story, please. ", "Great! "]
        )
        if lead.endswith("Now ") and not text.startswith("I "):
            text = text[0].lower() + text[1:]
        text = lead + text
    return text


def story(spec: StorySpec, rng: random.Random, ending_line: str = "") -> str:
    """A 3-6 sentence story that uses ``spec`` (the adjective and place are chosen if missing)."""
    name, animal = spec.name, spec.animal
    adj = spec.adjective or rng.choice(list(ADJECTIVES))
    place = spec.place or rng.choice(list(PLACES))
    pron = NAMES[name]
    pos = POSSESSIVE[pron]
    friend = rng.choice([a for a in ANIMALS if a != animal])
    fill = {"Name": name, "Pron": pron.capitalize(), "pron_lower": pron, "pos": pos}

    def fmt(s: str) -> str:
        return s.format(**fill)

    sentences: list[str] = []
    # 1. Opening: who the story is about (always the adjective, animal and name).
    opening = rng.randrange(4)
    said_place = opening >= 2
    char = with_article(f"{adj} {animal}")
    sentences.append(
        [
            f"Once upon a time, there was {char} named {name}.",
            f"There once was {char} called {name}.",
            f"Long ago, {char} named {name} lived {PLACES[place]}.",
            f"{name} was {char} who lived {PLACES[place]}.",
        ][opening]
    )

    # 2. Optional extras: where the character lives (unless the opening said it),
    #    what it is like, and later how the event turned out. Taking the first k
    #    of them keeps the order fixed and the length at 3-6 sentences.
    optional = ([] if said_place else ["place"]) + ["trait", "resolution"]
    chosen = set(optional[: rng.randrange(len(optional) + 1)])
    if spec.place and not said_place:
        chosen.add("place")  # a place the user asked for is always mentioned
    if "place" in chosen:
        sentences.append(
            rng.choice(
                [
                    f"{name} lived {PLACES[place]}.",
                    f"{pron.capitalize()} lived {PLACES[place]} with {pos} family.",
                ]
            )
        )
    if "trait" in chosen:
        sentences.append(fmt(rng.choice(ADJECTIVES[adj])))

    # 3. The event, and (optionally) how it turned out.
    event = rng.randrange(6)
    landmark = rng.choice(LANDMARKS)
    if event == 0:
        sentences.append(f"One day, {name} found {rng.choice(OBJECTS)} {rng.choice(SPOTS)}.")
        resolution = f"{pron.capitalize()} showed it to {pos} friend the {friend}, and they played with it together."
    elif event == 1:
        sentences.append(f"One day, {name} saw {with_article(friend)} stuck in the mud near the {landmark}.")
        resolution = f"{name} pulled with all {pos} strength until the {friend} was free."
    elif event == 2:
        sentences.append(f"One afternoon, {name} got lost on the way home.")
        resolution = f"{pron.capitalize()} followed the {landmark} and soon found the path again."
    elif event == 3:
        sentences.append("One day, dark clouds filled the sky and it began to rain.")
        resolution = f"{name} and {pos} friend the {friend} waited under a big leaf until the sun came back."
    elif event == 4:
        sentences.append(f"One morning, {name} decided to bake a cake for {pos} friend the {friend}.")
        resolution = f"The {friend} was so happy that it danced all afternoon."
    else:
        sentences.append(f"One day, {name} wanted to climb to the top of the {landmark}.")
        resolution = f"It was hard, but {name} did not give up and finally reached the top."
    # A friend stuck in the mud, getting lost or the rain need their happy
    # ending; finding something, a cake or a climb can stand on their own.
    if "resolution" in chosen or event in (1, 2, 3):
        sentences.append(resolution)

    # 4. The ending.
    sentences.append(
        rng.choice(
            [
                f"At the end of the day, {name} went home and slept well.",
                f"From that day on, everyone {PLACES_THE[place]} knew how {adj} {name} was.",
                f"{name} smiled, because it had been a wonderful day.",
                f"And {name} the {animal} lived happily ever after.",
                f"That night, {name} fell asleep with a big smile.",
            ]
        )
    )
    text = " ".join(sentences)
    if ending_line:
        text += " " + ending_line
    return text


# --------------------------------------------------------------------------- #
# Conversations
# --------------------------------------------------------------------------- #


@dataclass
class Example:
    """One training conversation: ``messages`` in the chat format."""

    messages: list[dict[str, str]] = field(default_factory=list)
    system_index: int | None = None


def make_example(rng: random.Random, p_system: float = 0.6, p_two_turns: float = 0.2) -> Example:
    """One conversation: [system], user, assistant, and maybe a second user/assistant turn."""
    ex = Example()
    ending = ""
    if rng.random() < p_system:
        ex.system_index = rng.randrange(len(SYSTEM_PROMPTS))
        ex.messages.append({"role": "system", "content": SYSTEM_PROMPTS[ex.system_index]})
        ending = SYSTEM_ENDINGS[ex.system_index]
    turns = 2 if rng.random() < p_two_turns else 1
    for turn in range(turns):
        spec = random_spec(rng)
        ex.messages.append({"role": "user", "content": user_request(spec, rng, follow_up=turn > 0)})
        ex.messages.append({"role": "assistant", "content": story(spec, rng, ending)})
    return ex


def make_corpus(n: int, seed: int = 0, **kwargs) -> list[Example]:
    """``n`` conversations drawn from ``random.Random(seed)`` (reproducible)."""
    rng = random.Random(seed)
    return [make_example(rng, **kwargs) for _ in range(n)]


def sample_requests(n: int = 16, seed: int = 1234) -> list[dict]:
    """Held-out story requests (text + what a correct story must mention), for evaluation."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        spec = random_spec(rng)
        out.append(
            {
                "request": user_request(spec, rng),
                "name": spec.name,
                "animal": spec.animal,
                "adjective": spec.adjective,
                "place": spec.place,
            }
        )
    return out


if __name__ == "__main__":  # print a few examples
    for ex in make_corpus(4, seed=0):
        for m in ex.messages:
            print(f"[{m['role']}] {m['content'][:300]}")
        print()
