"""Train timetable look-up: two tools, one returning a list; a ToolEnv written from docs/agents.md.

    tidal train examples/train_lookup.yaml

The policy sees `list_trains(origin, destination)`, which returns the day's departure times
as a list, and `weather_at(city)`. Most questions ask for a train (any departure on the list
is right), some for the weather: the policy has to pick the tool. Neither tool, nor this system
prompt, is one the embedded tiny tool model was trained on.
"""

import hashlib
import random
import re

from tidal.envs.tool_env import ToolEnv

STATIONS = ("Lyon", "Nice", "Lille", "Nantes", "Bordeaux", "Geneva", "Zurich", "Basel", "Turin", "Milan", "Genoa",
            "Munich", "Vienna", "Prague", "Leipzig", "Hamburg", "Bremen", "Utrecht", "Ghent", "Bruges")
WEATHER = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")
SYSTEM_PROMPT = "You are a travel assistant. Look things up with the tools, then reply <answer>...</answer>."
TRAIN_QUESTIONS = ("Which trains go from {a} to {b}?", "Find a train from {a} to {b}.",
                   "List the trains from {a} to {b}.", "When is there a train from {a} to {b}?")
WEATHER_QUESTIONS = ("What is the weather at {a}?", "How is the weather in {a}?")


def _h(*parts: str) -> int:
    return int.from_bytes(hashlib.sha256("|".join(parts).encode()).digest()[:8], "big")


def list_trains(origin: str, destination: str) -> list[str]:
    """List today's direct trains between two stations, as departure times.

    Args:
        origin: the departure station
        destination: the arrival station
    """
    for s in (origin, destination):
        if s not in STATIONS:
            raise ValueError(f"unknown station {s!r}")
    h = _h(origin, destination)
    return sorted({f"{6 + (h >> (5 * i)) % 16:02d}:{15 * ((h >> (5 * i + 3)) % 4):02d}" for i in range(2 + h % 3)})


def weather_at(city: str) -> str:
    """Today's weather in a city.

    Args:
        city: the city
    """
    if city not in STATIONS:
        raise ValueError(f"no weather for {city!r}")
    return WEATHER[_h("weather", city) % len(WEATHER)]


class TrainLookupEnv(ToolEnv):
    name = "train_lookup"
    tools = (list_trains, weather_at)
    default_system_prompt = SYSTEM_PROMPT

    @classmethod
    def rows(cls, split: str, n: int, seed: int, weather_frac: float = 0.25) -> list[dict]:
        """`n` distinct questions, each drawn about the weather with probability `weather_frac`;
        one in five is held out. There are 1560 distinct questions (about 1230 train, 330 held
        out), of which only 40 ask for the weather (20 stations, two phrasings): a large split runs
        out of them and the rest ask for trains (1000 train rows hold 27). Asking for more
        questions than there are is an error, not an endless draw."""
        pairs = [(a, b) for a in STATIONS for b in STATIONS if a != b]
        pool = {q.format(a=a, b=b) for a, b in pairs for q in TRAIN_QUESTIONS if weather_frac < 1}
        pool |= {q.format(a=a) for a in STATIONS for q in WEATHER_QUESTIONS if weather_frac > 0}
        have = sum((_h(text) % 5 == 0) == (split == "test") for text in pool)
        if n > have:
            raise ValueError(f"train_lookup: {n} {split} questions asked for (task.train_size / task.eval_size), "
                             f"but there are only {have} distinct ones")
        rng, rows, seen = random.Random(f"trains-{split}-{seed}"), [], set()
        while len(rows) < n:
            a, b = rng.sample(STATIONS, 2)
            weather = rng.random() < weather_frac
            text = rng.choice(WEATHER_QUESTIONS if weather else TRAIN_QUESTIONS).format(a=a, b=b)
            if text in seen or (_h(text) % 5 == 0) != (split == "test"):
                continue
            seen.add(text)
            rows.append({"prompt": text, "answers": [weather_at(a)] if weather else list_trains(a, b)})
        return rows


ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def score(completion: str, answers: list[str]) -> dict:
    """correct: the last answer is one of the right ones (any departure on the list)."""
    found = ANSWER.findall(completion)
    return {"correct": float(bool(found) and found[-1].strip().lower() in {a.lower() for a in answers})}
