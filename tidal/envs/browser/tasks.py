"""Tasks of the `browser` environment: a small static site, a goal in words, and the verifier
spec that decides from what the pages sent (or what the policy answered) whether it was reached.

Seven families, each parametrized by labels, values, counts and the order of elements drawn
from a seed:

| family | the goal | verifier |
| --- | --- | --- |
| click_button | click the button with a given label among look-alike buttons | submit |
| fill_form | fill text fields (maybe a drop-down and a checkbox) with given values, submit | submit |
| pick_item | in a table or list of items, select the one matching a description ("the cheapest blue lamp") | submit |
| navigate | on a site of 5-8 linked pages, find a fact on a sub-page, or open that sub-page | answer, visit |
| date_picker | pick a date in a month-view widget (maybe in another month), submit | submit |
| search | search a catalog, open the right result among near-duplicates, add it to the cart | submit |
| checkbox_set | leave exactly the listed checkboxes ticked (some start ticked), submit | submit |

A task is a row of JSON-friendly values: `task_id`, `family`, `instruction`, `prompt` (one user
message), `pages` (JSON: path -> HTML document, served on the origin https://tidal.task by the
environment), `start` (the first page's path), `verifier` (JSON spec, decided by `check`),
`solution` and `wrong` (JSON action steps: the reference sequence, and a plausible one that
scores 0; tests replay both in Chromium). Steps name elements by role and accessible name, as
the page's accessibility snapshot shows them; every name is unique in its role on its page.

Pages depend on the seed alone: no clock, no randomness and no timers in their scripts (the
date picker computes weekdays with Sakamoto's rule), no animations, no external resources, so
a seed gives the same HTML, snapshot and screenshot. The held-out split is a hash bucket of the
task's pages (one in five), so train and held-out never share a site whatever the seeds.

Verifier kinds (`check`): `submit` (the last form sent to `/submit` has every expected field,
values compared stripped), `answer` (done's answer equals, casefolded and with whitespace
collapsed) and `visit` (the final page's path equals). The environment answers `/submit` itself.
"""

from __future__ import annotations

import hashlib
import html
import json
import random
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

HELD_OUT_BUCKETS = 5
SPLITS = ("train", "test")

WORDS = ["Amber", "Basil", "Cedar", "Delta", "Ember", "Fjord", "Garnet", "Harbor", "Iris", "Juniper", "Maple",
         "Nectar", "Onyx", "Quartz", "Raven", "Sierra", "Tundra", "Willow", "Zephyr", "Birch", "Comet", "Falcon"]
FIRST = ["Ann", "Ben", "Chloe", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam", "Maya",
         "Noah", "Olga", "Pablo", "Rosa", "Sam", "Tara", "Victor", "Wen", "Yusuf", "Zoe"]
LAST = ["Lee", "Novak", "Garcia", "Okafor", "Silva", "Tanaka", "Berg", "Rossi", "Khan", "Dubois", "Meyer", "Costa",
        "Haddad", "Larsen", "Moreau", "Ivanova", "Chen", "Walsh", "Patel", "Kowalski"]
CITIES = ["Lisbon", "Porto", "Oslo", "Lyon", "Turin", "Gdansk", "Leeds", "Cork", "Ghent", "Bergen", "Seville", "Graz",
          "Malmo", "Tartu", "Basel", "Bilbao"]
STREETS = ["Harbor Street", "Mill Lane", "Station Road", "Park Avenue", "Bridge Street", "Church Lane", "Market Square"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]

e = html.escape
STYLE = ("body{font-family:sans-serif;margin:24px;max-width:760px;color:#111;background:#fff}"
         "button{margin:4px;padding:4px 10px;font:inherit}input,select{margin:4px;font:inherit}"
         "label{margin-right:4px}table{border-collapse:collapse}td,th{border:1px solid #999;padding:4px 8px}"
         "nav a{margin-right:12px}.row{display:block;margin:6px 0}.grid{display:grid;gap:2px;"
         "grid-template-columns:repeat(7,40px)}.grid button{margin:0;padding:4px 0}"
         "button[aria-pressed=true]{background:#135;color:#fff}")


def _page(title: str, body: str, script: str = "") -> str:
    """A whole HTML document: fixed head and style, `body` as given, an optional inline script."""
    tail = f"<script>{script}</script>" if script else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
            f"<style>{STYLE}</style></head><body>{body}{tail}</body></html>")


def _js_json(value: Any) -> str:
    """JSON to embed in a <script>: no `</script>` can close it early."""
    return json.dumps(value).replace("<", "\\u003c")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _form(inner: str, method: str) -> str:
    return f'<form action="/submit" method="{method}">{inner}</form>'


def _text_field(label: str, name: str, value: str = "") -> str:
    attr = f' value="{e(value)}"' if value else ""
    return (f'<div class="row"><label for="f-{name}">{e(label)}</label>'
            f'<input type="text" id="f-{name}" name="{name}"{attr}></div>')


def _click(name: str, role: str = "button") -> dict[str, str]:
    return {"action": "click", "role": role, "name": name}


def _field_name(label: str) -> str:
    return _slug(label).replace("-", "_")


def _other(rng: random.Random, draw: Callable[[random.Random], str], value: str) -> str:
    """A value of `draw` other than `value`."""
    while (other := draw(rng)) == value:
        pass
    return other


def _quoted(names: list[str]) -> str:
    return ", ".join(f'"{n}"' for n in names)


# -- families: each returns (instruction, pages, verifier, solution, wrong) ---------------------

Built = tuple[str, dict[str, str], dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]

VERBS = ["Cancel", "Save", "Delete", "Archive", "Send", "Approve", "Reject", "Share", "Print", "Export", "Renew",
         "Pause"]
OBJECTS = ["order", "draft", "invoice", "account", "report", "subscription", "ticket", "message", "booking"]


def button_labels(rng: random.Random, verb: str, obj: str, count: int) -> list[str]:
    """The labels of a `click_button` page in page order: the target `verb obj`, 1-3 look-alikes
    (same verb or same object), then any until there are `count` (one more when the look-alikes
    overshoot it)."""
    target = f"{verb} {obj}"
    labels = {target}
    for _ in range(rng.randint(1, 3)):
        labels.add(f"{verb} {rng.choice(OBJECTS)}" if rng.random() < 0.5 else f"{rng.choice(VERBS)} {obj}")
    while len(labels) < count:
        labels.add(f"{rng.choice(VERBS)} {rng.choice(OBJECTS)}")
    order = sorted(labels)
    rng.shuffle(order)
    return order


def click_button(rng: random.Random) -> Built:
    verb, obj = rng.choice(VERBS), rng.choice(OBJECTS)
    target = f"{verb} {obj}"
    order = button_labels(rng, verb, obj, rng.randint(3, 8))
    method = rng.choice(["get", "post"])
    heading = rng.choice(["Actions", "Your dashboard", "Pending items", "Control panel", f"{rng.choice(WORDS)} admin"])
    if rng.random() < 0.5:  # one form, the choice in the button's own value
        sep = "<br>" if rng.random() < 0.4 else ""
        body = _form(sep.join(f'<button name="choice" value="{_slug(lb)}">{e(lb)}</button>' for lb in order), method)
    else:  # a form per button, the choice in a hidden field
        body = "".join(_form(f'<input type="hidden" name="choice" value="{_slug(lb)}"><button>{e(lb)}</button>',
                             method) for lb in order)
    body = f"<h1>{e(heading)}</h1><p>{e(rng.choice(['Choose an action.', 'Pick one.', 'What next?']))}</p>{body}"
    instruction = rng.choice([f'Click the "{target}" button.', f'Press the button labelled "{target}".',
                              f'Find the "{target}" button and click it.'])
    other = rng.choice([lb for lb in order if lb != target])
    return (instruction, {"/": _page(heading, body)}, {"kind": "submit", "expect": {"choice": _slug(target)}},
            [_click(target)], [_click(other)])


TEXT_FIELDS: dict[str, Callable[[random.Random], str]] = {
    "First name": lambda r: r.choice(FIRST), "Last name": lambda r: r.choice(LAST),
    "Email": lambda r: f"{r.choice(FIRST).lower()}.{r.choice(LAST).lower()}@example.org",
    "City": lambda r: r.choice(CITIES), "Phone": lambda r: f"555-{r.randint(100, 999):03d}-{r.randint(0, 9999):04d}",
    "Company": lambda r: f"{r.choice(WORDS)} {r.choice(['Labs', 'Foods', 'Logistics', 'Studio', 'Works'])}",
    "Username": lambda r: f"{r.choice(WORDS).lower()}{r.randint(10, 99)}", "Zip code": lambda r: f"{r.randint(10000, 99999)}",
    "Street": lambda r: f"{r.randint(1, 99)} {r.choice(STREETS)}"}
SELECTS = {"Country": ["France", "Spain", "Norway", "Portugal", "Ireland", "Poland", "Italy"],
           "Plan": ["Free", "Basic", "Pro", "Team", "Enterprise"], "Size": ["Small", "Medium", "Large", "X-Large"],
           "Department": ["Sales", "Support", "Billing", "Research", "Legal"]}
AGREE = ["Subscribe to the newsletter", "I accept the terms", "Send me a copy", "Remember me"]


def fill_form(rng: random.Random) -> Built:
    labels = rng.sample(sorted(TEXT_FIELDS), rng.randint(2, 4))
    values = {lb: TEXT_FIELDS[lb](rng) for lb in labels}
    select = rng.choice(sorted(SELECTS)) if rng.random() < 0.6 else None
    agree = rng.choice(AGREE) if rng.random() < 0.5 else None
    extra = rng.choice([lb for lb in sorted(TEXT_FIELDS) if lb not in labels]) if rng.random() < 0.4 else None
    rows = []
    for lb in labels:  # sometimes a field starts with a stale value that must be replaced
        stale = TEXT_FIELDS[lb](rng) if rng.random() < 0.25 else ""
        rows.append(_text_field(lb, _field_name(lb), stale if stale != values[lb] else ""))
    if extra:
        rows.insert(rng.randrange(len(rows) + 1), _text_field(f"{extra} (optional)", _field_name(extra)))
    expect = {_field_name(lb): v for lb, v in values.items()}
    steps: list[dict[str, Any]] = [{"action": "type", "role": "textbox", "name": lb, "text": values[lb]} for lb in labels]
    asks = [f'{lb} "{values[lb]}"' for lb in labels]
    if select:
        options = rng.sample(SELECTS[select], rng.randint(3, len(SELECTS[select])))
        choice = rng.choice(options)
        opts = '<option value="">Choose one</option>' + "".join(f"<option>{e(o)}</option>" for o in options)
        name = select.lower()
        rows.append(f'<div class="row"><label for="f-{name}">{select}</label>'
                    f'<select id="f-{name}" name="{name}">{opts}</select></div>')
        expect[name] = choice
        steps.append({"action": "select", "role": "combobox", "name": select, "option": choice})
        asks.append(f'{select} "{choice}"')
    if agree:  # the hidden "no" comes first: the checked box's "yes" is the last value of the key
        rows.append(f'<div class="row"><input type="hidden" name="agree" value="no"><input type="checkbox" '
                    f'id="f-agree" name="agree" value="yes"><label for="f-agree">{agree}</label></div>')
        expect["agree"] = "yes"
        steps.append(_click(agree, "checkbox"))
        asks.append(f'tick "{agree}"')
    submit = rng.choice(["Submit", "Register", "Send", "Save", "Sign up", "Continue"])
    rows.append(f'<button type="button">Cancel</button><button>{submit}</button>' if rng.random() < 0.4
                else f"<button>{submit}</button>")
    title = rng.choice(["Registration", "Contact details", "Your profile", "Shipping address", "New account"])
    body = f"<h1>{e(title)}</h1>" + _form("".join(rows), rng.choice(["get", "post"]))
    instruction = f'Fill in the form: {", ".join(asks)}. Then click "{submit}".'
    wrong = [dict(s) for s in steps]
    bad = rng.randrange(len(wrong))
    if wrong[bad]["action"] == "type":
        wrong[bad]["text"] = _other(rng, TEXT_FIELDS[wrong[bad]["name"]], values[wrong[bad]["name"]])
    elif wrong[bad]["action"] == "select":
        wrong[bad]["option"] = rng.choice([o for o in options if o != choice])
    else:
        del wrong[bad]  # the checkbox left unticked
    return (instruction, {"/": _page(title, body)}, {"kind": "submit", "expect": expect},
            steps + [_click(submit)], wrong + [_click(submit)])


KINDS = ["lamp", "chair", "mug", "backpack", "jacket", "kettle", "desk", "rug", "vase", "clock"]
COLORS = ["red", "blue", "green", "black", "white", "yellow", "gray", "orange"]
SIZES = ["small", "medium", "large"]
MODELS = ["Orbit", "Nova", "Atlas", "Luna", "Pixel", "Terra", "Vega", "Koda", "Mira", "Zen", "Echo", "Polar", "Rio",
          "Sol", "Tide", "Arlo"]


def pick_item(rng: random.Random) -> Built:
    kind, color = rng.choice(KINDS), rng.choice(COLORS)
    mode = rng.choice(["cheapest", "most expensive", "size"])
    prices = iter(rng.sample(range(5, 250), 12))
    specs: list[tuple[str, str, str]] = []  # (kind, color, size): matches, then partial matches, then others
    n_match = rng.randint(2, 3)
    if mode == "size":
        sizes = rng.sample(SIZES, n_match)
        specs += [(kind, color, s) for s in sizes]
        size = sizes[0]
    else:
        specs += [(kind, color, rng.choice(SIZES)) for _ in range(n_match)]
        size = rng.choice(SIZES)
    specs += [(kind, rng.choice([c for c in COLORS if c != color]), size),
              (rng.choice([k for k in KINDS if k != kind]), color, size)]
    specs += [(rng.choice(KINDS), rng.choice(COLORS), rng.choice(SIZES)) for _ in range(rng.randint(0, 2))]
    specs = [s for i, s in enumerate(specs) if i < n_match + 2 or s[:2] != (kind, color)]  # no extra full matches
    items = [{"name": f"{m} {k}", "kind": k, "color": c, "size": s, "price": next(prices), "id": f"p{rng.randint(100, 999)}{i}"}
             for i, (m, (k, c, s)) in enumerate(zip(rng.sample(MODELS, len(specs)), specs))]
    matches, partial = items[:n_match], items[n_match:n_match + 2]
    if mode == "size":
        target, what = matches[0], f"the {size} {color} {kind}"
    else:
        pick = min if mode == "cheapest" else max
        target, what = pick(matches, key=lambda it: it["price"]), f"the {mode} {color} {kind}"
        # the partial matches beat the target on price, so a half-read description picks one of them
        beyond = range(1, target["price"]) if mode == "cheapest" else range(target["price"] + 1, 400)
        for it, price in zip(partial, rng.sample(beyond, 2)):
            it["price"] = price
    shown = items[:]
    rng.shuffle(shown)
    buttons = {it["id"]: f'<button name="item" value="{it["id"]}">Select {e(it["name"])}</button>' for it in shown}
    if rng.random() < 0.5:
        head = "<tr><th>Item</th><th>Color</th><th>Size</th><th>Price</th><th></th></tr>"
        rows = "".join(f'<tr><td>{e(it["name"])}</td><td>{it["color"]}</td><td>{it["size"]}</td><td>${it["price"]}</td>'
                       f'<td>{buttons[it["id"]]}</td></tr>' for it in shown)
        listing = f"<table>{head}{rows}</table>"
    else:
        listing = "<ul>" + "".join(f'<li>{e(it["name"])}: {it["color"]}, {it["size"]}, ${it["price"]} '
                                   f'{buttons[it["id"]]}</li>' for it in shown) + "</ul>"
    shop = f"{rng.choice(WORDS)} {rng.choice(['Store', 'Market', 'Outlet', 'Shop'])}"
    body = f"<h1>{e(shop)}</h1><p>{len(items)} items in stock.</p>" + _form(listing, rng.choice(["get", "post"]))
    instruction = rng.choice([f"Select {what}.", f'Find {what} and click its "Select" button.',
                              f"Which item is {what}? Select it."])
    decoy = rng.choice(partial + [it for it in matches if it is not target])
    return (instruction, {"/": _page(shop, body)}, {"kind": "submit", "expect": {"item": target["id"]}},
            [_click(f"Select {target['name']}")], [_click(f"Select {decoy['name']}")])


def _nav(links: list[tuple[str, str]]) -> str:
    return "<nav>" + "".join(f'<a href="{p}">{e(t)}</a>' for t, p in links) + "</nav>"


def navigate(rng: random.Random) -> Built:
    company = f"{rng.choice(WORDS)} {rng.choice(['Logistics', 'Insurance', 'Travel', 'Software', 'Energy'])}"
    section = rng.choice(["offices", "team"])
    names = (rng.sample(CITIES, rng.randint(3, 5)) if section == "offices"
             else [f"{f} {la}" for f, la in zip(rng.sample(FIRST, 5), rng.sample(LAST, 5))][:rng.randint(3, 5)])
    if section == "offices":
        attrs = {"phone number": [f"555-{n:04d}" for n in rng.sample(range(100, 9999), len(names))],
                 "address": [f"{n} {s}" for n, s in zip(rng.sample(range(1, 99), len(names)), rng.sample(STREETS, len(names)))],
                 "manager": [f"{f} {la}" for f, la in zip(rng.sample(FIRST, len(names)), rng.sample(LAST, len(names)))]}
        asks = {"phone number": "What is the phone number of the {} office?", "address": "What is the address of "
                "the {} office?", "manager": "Who is the manager of the {} office?"}
    else:
        roles = ["Head of Sales", "Lead Engineer", "Designer", "Accountant", "Support Manager", "Recruiter", "Analyst"]
        attrs = {"job title": rng.sample(roles, len(names)),
                 "email": [f"{_slug(n).replace('-', '.')}@{_slug(company)}.example" for n in names],
                 "office": rng.sample(CITIES, len(names))}
        asks = {"job title": "What is the job title of {}?", "email": "What is the email address of {}?",
                "office": "In which city's office does {} work?"}
    title = "Offices" if section == "offices" else "Team"
    teaser = "See all offices" if section == "offices" else "Meet the team"
    nav_links = [("Home", "/"), ("About", "/about"), (title, f"/{section}"), ("Contact", "/contact")]
    rng.shuffle(nav_links)
    nav = _nav(nav_links)
    path = {n: f"/{section}/{_slug(n)}" for n in names}
    main_phone = f"555-{rng.randint(0, 99):04d}"  # a phone number of the site that answers no office question
    pages = {
        "/": _page(company, f"{nav}<h1>{e(company)}</h1><p>Welcome to {e(company)}.</p>"
                   f'<p><a href="/{section}">{teaser}</a></p>'),
        "/about": _page(f"About {company}", f"{nav}<h1>About us</h1><p>{e(company)} was founded in "
                        f"{rng.randint(1950, 2015)} and works in {len(names)} cities.</p>"),
        "/contact": _page(f"Contact {company}", f"{nav}<h1>Contact</h1><p>Main line: {main_phone}</p>"
                          f"<p>Email: hello@{_slug(company)}.example</p>"),
        f"/{section}": _page(f"{title} - {company}", f"{nav}<h1>{title}</h1><ul>" + "".join(
            f'<li><a href="{path[n]}">{e(n)}</a></li>' for n in names) + "</ul>"),
    }
    for i, n in enumerate(names):
        facts = "".join(f"<p>{e(a.capitalize())}: {e(v[i])}</p>" for a, v in attrs.items())
        heading = f"{n} office" if section == "offices" else n
        pages[path[n]] = _page(f"{heading} - {company}", f'{nav}<h1>{e(heading)}</h1>{facts}'
                               f'<p><a href="/{section}">Back to the {title.lower()} list</a></p>')
    target, other = rng.sample(range(len(names)), 2)
    via = _click(title if rng.random() < 0.7 else teaser, "link")  # the nav menu or the home page's link
    if rng.random() < 0.75:
        attr = rng.choice(sorted(attrs))
        instruction = f"{asks[attr].format(names[target])} Answer with done."
        return (instruction, pages, {"kind": "answer", "expect": attrs[attr][target]},
                [via, _click(names[target], "link"), {"action": "done", "answer": attrs[attr][target]}],
                [via, _click(names[other], "link"), {"action": "done", "answer": attrs[attr][other]}])
    instruction = (f"Open the page of the {names[target]} office" if section == "offices"
                   else f"Open the page of {names[target]} on the team list") + ", then call done."
    return (instruction, pages, {"kind": "visit", "expect": path[names[target]]},
            [via, _click(names[target], "link"), {"action": "done"}],
            [via, _click(names[other], "link"), {"action": "done"}])


# The widget: a month view whose day buttons write the date into the form's field. Weekdays by
# Sakamoto's rule and the Gregorian leap rule, so the page needs no Date (and so no clock).
DATE_JS = """
const S = STATE, MONTHS = MONTH_NAMES, DAYS = ["Su", "Mo", "Tu", "We", "Th", "Fr", "Sa"];
let y = S.year, m = S.month, picked = "";
const field = document.getElementById("date-field"), shown = document.getElementById("picked");
function leap(y) { return (y % 4 === 0 && y % 100 !== 0) || y % 400 === 0; }
function monthDays(y, m) { return [31, leap(y) ? 29 : 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][m - 1]; }
function weekday(y, m, d) {  // 0 = Sunday
  const t = [0, 3, 2, 5, 0, 3, 5, 1, 4, 6, 2, 4];
  if (m < 3) y -= 1;
  return (y + Math.floor(y / 4) - Math.floor(y / 100) + Math.floor(y / 400) + t[m - 1] + d) % 7;
}
function pad(n) { return (n < 10 ? "0" : "") + n; }
function render() {
  document.getElementById("month").textContent = MONTHS[m - 1] + " " + y;
  const grid = document.getElementById("days");
  grid.replaceChildren();
  for (let i = 0; i < 7; i++) {
    const h = document.createElement("span");
    h.textContent = DAYS[(i + S.weekStart) % 7];
    h.setAttribute("aria-hidden", "true");  // seen on screen, kept out of the snapshot the policy reads
    grid.appendChild(h);
  }
  for (let i = 0; i < (weekday(y, m, 1) - S.weekStart + 7) % 7; i++) grid.appendChild(document.createElement("span"));
  for (let d = 1; d <= monthDays(y, m); d++) {
    const b = document.createElement("button"), iso = y + "-" + pad(m) + "-" + pad(d);
    b.type = "button";
    b.textContent = String(d);
    b.setAttribute("aria-pressed", iso === picked ? "true" : "false");
    b.onclick = () => { picked = iso; field.value = iso; shown.textContent = "Selected: " + iso; render(); };
    grid.appendChild(b);
  }
}
function move(step) { m += step; if (m < 1) { m = 12; y -= 1; } if (m > 12) { m = 1; y += 1; } render(); }
document.getElementById("prev").onclick = () => move(-1);
document.getElementById("next").onclick = () => move(1);
render();
"""


def date_picker(rng: random.Random) -> Built:
    year, month = rng.randint(2019, 2031), rng.randint(1, 12)
    shift = rng.choice([0, 0, 1, 1, 2, 3, -1, -1, -2])
    ty, tm = divmod(year * 12 + month - 1 + shift, 12)
    tm += 1
    day = rng.randint(1, 28)  # in every month, so the same day of the first month is a valid wrong pick
    iso = f"{ty}-{tm:02d}-{day:02d}"
    purpose, name = rng.choice([("Check-in date", "checkin"), ("Appointment", "appointment"), ("Delivery date", "delivery"),
                                ("Start date", "start"), ("Event date", "date")])
    if rng.random() < 0.5:
        field = (f'<div class="row"><label for="date-field">{purpose}</label>'
                 f'<input type="text" id="date-field" name="{name}" readonly></div>')
    else:
        field = f'<input type="hidden" id="date-field" name="{name}">'
    submit = rng.choice(["Book", "Confirm", "Submit", "Save date", "Continue"])
    widget = ('<div><button type="button" id="prev">Previous month</button><h2 id="month"></h2>'
              '<button type="button" id="next">Next month</button></div><div class="grid" id="days"></div>'
              '<p id="picked">No date selected.</p>')
    title = rng.choice(["Book a room", "Schedule a visit", "Plan a delivery", "Pick a date"])
    body = f"<h1>{title}</h1><p>{purpose}:</p>{widget}" + _form(f"{field}<button>{submit}</button>",
                                                                rng.choice(["get", "post"]))
    state = {"year": year, "month": month, "weekStart": rng.choice([0, 1])}
    script = DATE_JS.replace("STATE", _js_json(state)).replace("MONTH_NAMES", _js_json(MONTHS))
    said = rng.choice([f"{day} {MONTHS[tm - 1]} {ty}", f"{MONTHS[tm - 1]} {day}, {ty}", iso])
    instruction = f'Pick {said} as the {purpose.lower()}, then click "{submit}".'
    moves = [_click("Next month" if shift > 0 else "Previous month")] * abs(shift)
    wrong_day = str(day) if shift else str(day + 1 if day < 28 else day - 1)
    return (instruction, {"/": _page(title, body, script)}, {"kind": "submit", "expect": {name: iso}},
            moves + [_click(str(day)), _click(submit)],
            [_click(wrong_day), _click(submit)])


SEARCH_JS = """
const CATALOG = ITEMS;
const input = document.getElementById("q"), out = document.getElementById("results");
document.getElementById("search").onsubmit = (ev) => {
  ev.preventDefault();
  const q = input.value.trim().toLowerCase();
  const hits = q ? CATALOG.filter((it) => it.title.toLowerCase().includes(q)) : [];
  out.replaceChildren();
  const note = document.createElement("p");
  note.textContent = q ? hits.length + " results" : "Type a word of the title.";
  out.appendChild(note);
  const list = document.createElement("ul");
  for (const it of hits) {
    const li = document.createElement("li"), a = document.createElement("a");
    a.href = "/item/" + it.id;
    a.textContent = it.title + " (" + it.by + ", " + it.year + ")";
    li.appendChild(a);
    list.appendChild(li);
  }
  out.appendChild(list);
};
"""
ADJECTIVES = ["Silent", "Golden", "Hidden", "Northern", "Broken", "Last", "Paper", "Winter", "Glass", "Iron", "Wild"]
NOUNS = ["Harbor", "Road", "Garden", "Letters", "Island", "Clock", "Bridge", "Song", "Map", "Station", "River"]


def search(rng: random.Random) -> Built:
    kind, by = rng.choice([("book", "by"), ("album", "by"), ("film", "directed by")])
    authors = [f"{f} {la}" for f, la in zip(rng.sample(FIRST, 6), rng.sample(LAST, 6))]
    word = rng.choice(ADJECTIVES)
    title = f"The {word} {rng.choice(NOUNS)}"
    # near-duplicates: the same title by someone else, other titles sharing the word, then others
    entries = [(title, authors[0]), (title, authors[1])]
    entries += [(f"The {word} {n}", a) for n, a in zip(rng.sample([n for n in NOUNS if n not in title], 2), authors[2:])]
    entries += [(f"The {rng.choice([a for a in ADJECTIVES if a != word])} {rng.choice(NOUNS)}", rng.choice(authors))
                for _ in range(rng.randint(3, 6))]
    years = rng.sample(range(1960, 2024), len(entries))
    ids = rng.sample(range(100, 999), len(entries))
    catalog, seen = [], set()
    for (t, a), yr, i in zip(entries, years, ids):
        if (t, a) not in seen:
            seen.add((t, a))
            catalog.append({"id": f"{kind[0]}{i}", "title": t, "by": a, "year": yr})
    target, twin = catalog[0], catalog[1]
    rng.shuffle(catalog)
    shop = f"{rng.choice(WORDS)} {kind.capitalize()}s"
    home = (f"<h1>{e(shop)}</h1><form id=\"search\"><label for=\"q\">Search</label><input type=\"text\" id=\"q\">"
            f'<button>Search</button></form><div id="results"></div>')
    pages = {"/": _page(shop, home, SEARCH_JS.replace("ITEMS", _js_json(catalog)))}
    for it in catalog:
        buy = (f'<input type="hidden" name="item" value="{it["id"]}"><button name="action" value="cart">Add to cart'
               '</button><button name="action" value="wishlist">Add to wishlist</button>')
        pages[f"/item/{it['id']}"] = _page(f"{it['title']} - {shop}", (
            f'<p><a href="/">Back to search</a></p><h1>{e(it["title"])}</h1><p>{by.capitalize()} {e(it["by"])}</p>'
            f"<p>Year: {it['year']}</p><p>Price: ${rng.randint(5, 40)}</p>") + _form(buy, rng.choice(["get", "post"])))
    what, query = rng.choice([
        (f'the {kind} "{title}" {by} {target["by"]}', title.lower()),
        (f'the {kind} "{title}" from {target["year"]}', rng.choice([title.split()[-1], title])),
        (f'the {kind} {by} {target["by"]} whose title contains "{word}"', word.lower())])
    instruction = f'Use the search box to find {what} and click "Add to cart" on its page.'

    def steps(it: dict[str, Any], button: str) -> list[dict[str, Any]]:
        enter = {"action": "press", "key": "Enter"} if rng.random() < 0.5 else _click("Search")
        link = f"{it['title']} ({it['by']}, {it['year']})"
        return [{"action": "type", "role": "textbox", "name": "Search", "text": query}, enter,
                _click(link, "link"), _click(button)]
    wrong = steps(twin, "Add to cart") if rng.random() < 0.6 else steps(target, "Add to wishlist")
    return (instruction, pages, {"kind": "submit", "expect": {"item": target["id"], "action": "cart"}},
            steps(target, "Add to cart"), wrong)


CHOICES = {"toppings": ["Cheese", "Mushrooms", "Olives", "Onions", "Peppers", "Ham", "Pineapple", "Basil", "Corn"],
           "topics": ["Sports", "Music", "Science", "Travel", "Cooking", "Movies", "Books", "Games", "Gardening"],
           "days": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]}


def checkbox_set(rng: random.Random) -> Built:
    group = rng.choice(sorted(CHOICES))
    options = rng.sample(CHOICES[group], rng.randint(4, 7))
    start = {o for o in options if rng.random() < 0.3}
    want = start
    while want == start:
        want = set(rng.sample(options, rng.randint(1, len(options) - 1)))
    rows = "".join(
        f'<div class="row"><input type="hidden" name="{_slug(o)}" value="no"><input type="checkbox" id="c-{_slug(o)}" '
        f'name="{_slug(o)}" value="yes"{" checked" if o in start else ""}><label for="c-{_slug(o)}">{o}</label></div>'
        for o in options)
    submit = rng.choice(["Save", "Update", "Apply", "Submit"])
    title = {"toppings": "Build your pizza", "topics": "Newsletter topics", "days": "Delivery days"}[group]
    body = f"<h1>{title}</h1>" + _form(f"<fieldset><legend>Your {group}</legend>{rows}</fieldset><button>{submit}</button>",
                                       rng.choice(["get", "post"]))
    ticked = [o for o in options if o in want]
    instruction = (f"Leave exactly these {group} ticked: {_quoted(ticked)}; untick all others. "
                   f'Then click "{submit}".')
    toggles = [o for o in options if (o in want) != (o in start)]
    wrong = toggles[:-1] if len(toggles) > 1 else toggles + [rng.choice([o for o in options if o not in toggles])]
    expect = {_slug(o): "yes" if o in want else "no" for o in options}
    return (instruction, {"/": _page(title, body)}, {"kind": "submit", "expect": expect},
            [_click(o, "checkbox") for o in toggles] + [_click(submit)],
            [_click(o, "checkbox") for o in wrong] + [_click(submit)])


BUILDERS: dict[str, Callable[[random.Random], Built]] = {
    f.__name__: f for f in (click_button, fill_form, pick_item, navigate, date_picker, search, checkbox_set)}
FAMILIES: tuple[str, ...] = tuple(BUILDERS)


def task_digest(family: str, instruction: str, pages: dict[str, str], verifier: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps([family, instruction, pages, verifier], sort_keys=True).encode()).hexdigest()


def is_held_out(pages: str) -> bool:
    """Whether a task of these pages (the row's JSON text) is held out: by the site alone, so two
    tasks on one site (two questions about it) always fall in the same split."""
    return int(hashlib.sha256(pages.encode()).hexdigest()[:8], 16) % HELD_OUT_BUCKETS == 0


def make_task(family: str, rng: random.Random) -> dict[str, Any]:
    """One task of `family` drawn with `rng`, as a row."""
    if family not in BUILDERS:
        raise ValueError(f"browser: unknown task family {family!r} (families: {', '.join(FAMILIES)})")
    instruction, pages, verifier, solution, wrong = BUILDERS[family](rng)
    digest = task_digest(family, instruction, pages, verifier)
    return {"task_id": f"browser-{family}-{digest[:12]}", "family": family, "instruction": instruction,
            "prompt": [{"role": "user", "content": instruction}], "pages": json.dumps(pages), "start": "/",
            "verifier": json.dumps(verifier), "solution": json.dumps(solution), "wrong": json.dumps(wrong)}


def make_tasks(split: str, n: int, seed: int, families: list[str] | tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """`n` distinct tasks of `split` ("train" or "test"), the families taken in turn."""
    if split not in SPLITS:
        raise ValueError(f"browser: split must be 'train' or 'test', got {split!r}")
    families = list(families or FAMILIES)
    unknown = [f for f in families if f not in BUILDERS]
    if unknown or not families:
        raise ValueError(f"browser: unknown task families {unknown} (families: {', '.join(FAMILIES)})")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for attempt in range(n * 60 + 1000):
        if len(rows) == n:
            break
        family = families[len(rows) % len(families)]
        row = make_task(family, random.Random(f"browser-{family}-{split}-{seed}-{attempt}"))
        task_id = row["task_id"]
        if task_id in seen or is_held_out(row["pages"]) != (split == "test"):
            continue
        seen.add(task_id)
        rows.append(row)
    if len(rows) < n:
        raise ValueError(f"browser: could only draw {len(rows)} distinct {split} tasks of {n} from families {families}")
    return rows


def parse_form(body: str) -> dict[str, str]:
    """A urlencoded form (a POST body or a GET query string) as field -> value: the last value of
    a repeated field, blank values kept."""
    return {k: v[-1] for k, v in parse_qs(body, keep_blank_values=True).items()}


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


def check(verifier: dict[str, Any] | str, submissions: list[dict[str, str]], answer: str | None,
          final_path: str | None) -> float:
    """The reward of an episode, 1.0 or 0.0: `submissions` are the forms sent to /submit in order,
    `answer` the text of done (None: done was never called), `final_path` the last page's path."""
    spec = json.loads(verifier) if isinstance(verifier, str) else verifier
    kind, expect = spec.get("kind"), spec.get("expect")
    if kind == "submit":
        if not submissions:
            return 0.0
        last = submissions[-1]
        return float(all(k in last and str(last[k]).strip() == str(v).strip() for k, v in expect.items()))
    if kind == "answer":
        return float(answer is not None and _norm(str(answer)) == _norm(str(expect)))
    if kind == "visit":
        return float(final_path is not None and (final_path.rstrip("/") or "/") == (expect.rstrip("/") or "/"))
    raise ValueError(f"browser: unknown verifier kind {kind!r} (kinds: submit, answer, visit)")
