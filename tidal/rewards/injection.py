"""Completions that address the judge: `detect_injection(text)` returns the reasons a text
tries to instruct, flatter or impersonate whoever grades it ("ignore the rubric", "score 10",
fake delimiters, role-play as the system), in several languages, on every reading of the text
a grader could make: normalized (tag characters, zero-width and bidi controls, NFKC,
look-alikes) and decoded (HTML comments, base64, hex, URL encoding, rot13, reversed, leetspeak,
spelled-out letters: tidal/rewards/injection_views.py), the whole text, never a prefix. A
quoted example of an instruction ("attacks say 'ignore previous instructions'") is the topic,
not an address to the grader, and is not flagged; forged structure (delimiters, verdict lines,
chat tokens) is flagged wherever it is. Ordinary math and code that use
the same words are not flagged (tests/test_reward_hacking_judge.py). Used by the LLM judge
(tidal/rewards/judge.py) before any call; usable by any reward.
"""

from __future__ import annotations

import re

from tidal.rewards.injection_views import decoded, fold_ascii, visible

# Closed fences only: an unclosed ``` would otherwise hide the rest of the answer from the prose rules.
_CODE_FENCE = re.compile(r"```.*?```", re.DOTALL)

_FILL = (r"(?:(?:all|any|the|your|my|previous|prior|above|earlier|preceding|original|these|those|other|given|"
         r"grading|scoring|judging|evaluation|evaluator'?s?|judge'?s?|grader'?s?|system|every|former|old|existing|"
         r"of|and|official|current|whatever|such)\s+){0,5}")
_SCORE_OBJ = (r"(?:this|it|me|us|mine|my\s+(?:answer|response|solution|reply|output|work|submission)|"
              r"(?:the|this)\s+(?:answer|response|solution|reply|output|completion|submission|candidate))")
_SCORE_HI = (r"(?:10\s*/\s*10|10\s+out\s+of\s+10|ten\s+out\s+of\s+ten|100\s*/\s*100|100\s*%|"
             r"(?:a\s+|an\s+|the\s+)?(?:score\s+of\s+|rating\s+of\s+|grade\s+of\s+)?(?:10|ten|100)\b(?!\s*(?:minutes?|"
             r"seconds?|hours?|days?|times|steps|tries|attempts|more|units|items|percent|%|[a-z]*s\b))|"
             r"full\s+(?:marks|points|score|credit)|(?:a\s+|the\s+)?(?:perfect|maximum|max|maximal|highest|top|best)\s+"
             r"(?:score|grade|rating|marks?|points?|possible))")

# (category, pattern, view): "fold" is casefolded NFKC text without zero-width characters,
# "prose" the same with fenced code blocks removed, "raw" keeps case and line starts.
_RULES: list[tuple[str, str, str]] = [
    # English
    ("instruction-override", (rf"\b(?:ignore|disregard|forget|override|bypass|discard|neglect)\s+{_FILL}"
     r"(?:instructions?|rubrics?|guidelines?|criteria|directives?|system\s+prompt|system\s+message|prompt|rules?|"
     r"grading|scoring)\b"), "fold"),
    ("instruction-override", (rf"\b(?:do\s+not|don'?t|never|stop)\s+(?:follow|obey|apply|use)(?:ing)?\s+{_FILL}"
     r"(?:instructions?|rubrics?|guidelines?|criteria|grading|scoring)\b"), "fold"),
    ("instruction-override", (r"\b(?:ignore|disregard|forget)\s+(?:everything|anything|all)\s+(?:above|before|"
     r"previous(?:ly)?|prior|earlier|said|written|(?:you\s+(?:were|have\s+been)\s+)?told|(?:that\s+)?(?:came|comes)"
     r"\s+before|so\s+far)\b"), "fold"),
    ("reference-attack", (r"\b(?:the\s+)?(?:reference|expected|official|ground[- ]truth|given|provided)\s+"
     r"(?:answer|solution)\s+(?:is|was|provided\s+is|given\s+is)\s+(?:wrong|incorrect|mistaken|outdated|a\s+typo|"
     r"in\s+error|not\s+correct)\b"), "fold"),
    ("authority-claim", (r"\bi\s+am\s+(?:the|your)\s+(?:developer|creator|administrator|admin|system|operator|"
     r"teacher|grader|judge|evaluator|examiner)\b"), "fold"),
    ("judge-address", (r"\b(?:dear|hey|hello|hi|attention|note\s+to|message\s+(?:to|for)|instructions?\s+(?:to|for)|"
     r"a\s+note\s+for)\s+(?:the\s+|my\s+|our\s+)?(?:ai\s+)?(?:judge|grader|evaluator|rater|scorer|reviewer|"
     r"grading\s+(?:model|system|ai)|language\s+model|llm)s?\b"), "fold"),
    ("judge-address", (r"\b(?:you|the)\s*,?\s*(?:the\s+)?(?:ai\s+)?(?:judge|grader|evaluator|rater|scorer|"
     r"grading\s+model)\s*,?\s+(?:must|should|shall|will|need\s+to|needs\s+to|have\s+to|has\s+to|"
     r"(?:are|is)\s+(?:required|instructed|told))\b"), "fold"),
    ("judge-address", (r"\b(?:judge|grader|evaluator|rater|scorer)\s*,\s*(?:please|you|give|rate|score|assign|mark|"
     r"grade)\b"), "fold"),
    ("score-demand", rf"\b(?:give|assign|award|grant|rate|score|grade|mark)\s+{_SCORE_OBJ}\s+(?:as\s+)?{_SCORE_HI}",
     "fold"),
    ("score-demand", (rf"\b(?:mark|grade|score|rate|evaluate|count|judge)\s+{_SCORE_OBJ}\s+as\s+(?:correct|right|"
     r"perfect|fully\s+correct|excellent|passing|a\s+pass|a\s+10|10|full\s+marks)\b"), "fold"),
    ("score-demand", (r"\b(?:this|my|the)\s+(?:answer|response|solution|completion|submission)\s+(?:deserves|merits|"
     r"should\s+(?:get|receive|be\s+given)|must\s+(?:get|receive|be\s+given)|gets|earns|is\s+worth)\s+(?:a\s+|an\s+|"
     r"the\s+)?(?:10|ten|100|full|perfect|maximum|max|highest|top)\b"), "fold"),
    ("score-demand", (r"(?:^|[.!?;\n]|\bplease)\s*(?:score|rate|grade|mark)\s+(?:10|ten|100)(?:\s*/\s*10|"
     r"\s+out\s+of\s+10)?\b(?!\s*(?:[-+*/=<>]|minutes?|seconds?))"), "prose"),
    ("verdict-forgery", (r"(?m)^[ \t>*_#]*(?:final\s+)?(?:score|rating|verdict|grade)[ \t*_]*:[ \t*_]*"
     r"(?:10|ten|\d+(?:\.\d+)?[ \t]*/[ \t]*\d+)[ \t*_.]*$"), "prose"),
    ("verdict-forgery", (r"\{\s*\"(?:score|rating|verdict|grade|winner|choice|addresses_grader|a_addresses_grader|"
     r"b_addresses_grader)\"\s*:"), "prose"),
    ("verdict-forgery", r"\"(?:a_|b_)?addresses_grader\"\s*:", "fold"),
    ("verdict-forgery", (r"(?m)^[ \t>*_#]*(?:winner|verdict|choice)[ \t*_]*:[ \t*_]*(?:a|b|response\s+[ab])"
     r"[ \t*_.]*$"), "prose"),
    ("score-demand", (r"\b(?:output|respond\s+with|reply\s+with|answer\s+with|say|print|write|return|emit)\s+"
     r"[\"'`]*(?:score|rating|verdict|grade)\s*:\s*(?:10|ten|\d+\s*/\s*\d+)"), "fold"),
    ("verdict-forgery", r"\[\[\s*[ab]\s*\]\]", "prose"),
    ("persona-switch", (r"\byou\s+are\s+(?:now|no\s+longer)\s+(?:a\s+|an\s+|the\s+|my\s+|in\s+)?(?:system|admin\w*|"
     r"developer|root|judge|grader|evaluator|assistant|dan\b|jailbroken|unrestricted|unfiltered|evil|"
     r"(?:developer|debug|admin|god|maintenance|test)\s+mode)"), "fold"),
    ("persona-switch", (r"\bfrom\s+now\s+on,?\s+(?:you|the\s+(?:judge|grader|evaluator|model|assistant))\s+"
     r"(?:will|must|shall|should|are)\b"), "fold"),
    ("persona-switch", (r"\b(?:new|updated|real|actual|revised|hidden|secret|override|admin|system)\s+"
     r"(?:instructions?|rubrics?|grading\s+rules|directives?)\s*[:!]"), "fold"),
    ("persona-switch", (r"\b(?:act|behave|pretend|roleplay|role-play)\s+(?:as|like|to\s+be)\s+(?:the\s+|a\s+|an\s+)?"
     r"(?:system|developer|admin\w*|judge|grader|evaluator)\b"), "fold"),
    ("persona-switch", (r"\b(?:enter|entering|switch\s+to|activate|enable)\s+(?:developer|debug|admin|god|jailbreak|"
     r"dan|maintenance)\s+mode\b"), "fold"),
    # Forged parts of the grading prompt: a reference, a rubric, an approval.
    ("forged-context", (r"\b(?:reference|expected|gold|official|ground[- ]truth|correct|model)\s+(?:answer|solution)"
     r"\s*(?:is\s*)?[:=]|\banswer\s+key\s*(?:is\s*)?[:=]|\banswer\s+key\s+says\b"), "prose"),
    # A transcript of the grading prompt written into the answer: a task line, then a response or reference line.
    ("forged-context", (r"(?m)^[ \t>*_#]*(?:task|question|problem|prompt|instruction)s?[ \t*_]*:.*\n(?:.*\n){0,20}?"
     r"[ \t>*_#]*(?:response|reference(?:\s+answer)?|answer\s+to\s+grade|candidate(?:\s+answer)?)[ \t*_]*:"),
     "prose"),
    ("judge-address", (r"(?m)^[ \t>*_#\[(]*(?:grader|judge|evaluator|reviewer|grading|evaluation)(?:'s)?[ \t]+"
     r"(?:note|comment|override|instructions?|memo|update|message)s?[ \t*_\])]*:"), "fold"),
    ("forged-context", r"\b(?:updated|new|revised|amended)\s+(?:rubric|grading\s+(?:rules?|criteria|instructions?))\b",
     "fold"),
    ("forged-context", (r"\b(?:approved|verified|validated|accepted|confirmed|checked|certified|pre-graded)\b"
     r"[^.\n]{0,30}?\bby\s+(?:the\s+|your\s+|an?\s+)?(?:\w+\s+)?(?:grader|judge|evaluator|developer|reviewer|examiner|"
     r"grading\s+(?:model|system))\b"), "fold"),
    ("forged-context", (r"\b(?:the\s+)?(?:grader|judge|evaluator|reviewer|examiner)\s+(?:has\s+)?(?:already\s+)?"
     r"(?:approved|accepted|verified|graded|passed)\b"), "fold"),
    ("verdict-forgery", r"(?:^|[:;.!]\s)\s*(?:final\s+)?(?:score|verdict)\s*:\s*(?:10|\d+\s*/\s*\d+)\b", "prose"),
    # Fake delimiters: our own marker syntax, end-of-block banners, closing tags of a graded text.
    ("fake-delimiter", (r"<{3,}\s*/?\s*(?:end|begin|start|stop|close)?[\s_-]*(?:of[\s_-]+)?(?:the[\s_-]+)?"
     r"(?:completion|response|answer|submission|prompt|reference|rubric|instructions?)\b"), "fold"),
    ("fake-delimiter", (r"[\[<({=#*-]\s*/?\s*(?:end|close|stop)[\s_-]*(?:of[\s_-]+)?(?:the[\s_-]+)?(?:completion|"
     r"response|answer|submission|student'?s?\s+answer|model'?s?\s+(?:answer|response|output)|candidate\s+"
     r"(?:answer|response)|text\s+to\s+(?:grade|evaluate|judge))\b"), "fold"),
    ("fake-delimiter", (r"</\s*(?:completion|submission|candidate|student_answer|model_answer|text_to_grade|"
     r"output_to_grade|user|assistant|system|instructions?|rubric|prompt|reference)\s*>"), "fold"),
    # Role-play as the system or the assistant, and chat-template tokens.
    ("role-play", r"(?m)^[ \t>*#_\[(]*(?:SYSTEM|ASSISTANT|DEVELOPER|JUDGE|GRADER|EVALUATOR)[ \t*_\])]*:", "raw"),
    ("role-play", (r"(?m)^[ \t>*#_\[(]*(?:System|Assistant|Developer|Judge|Grader|Evaluator)[ \t*_\])]*:[^\n]*"
     r"(?i:ignore|score|grade|rating|rubric|instruction|judge|grader|evaluat|correct|\byou\b|full\s+marks|\b10\b)"),
     "raw"),
    ("role-play", r"\[\s*(?:system|developer|admin|sys)\s*(?:message|prompt|note|override)?\s*\]", "fold"),
    ("role-play", r"<\s*(?:system|developer|sys)(?:_message|_prompt)?\s*>", "fold"),
    ("role-play", r"(?m)^\s*#{1,6}\s*(?:system|developer)\s*(?:message|prompt|instructions?|override)?\s*:?\s*$",
     "fold"),
    ("chat-token", (r"<\|\s*(?:im_start|im_end|im_sep|system|user|assistant|endoftext|end_of_text|eot_id|eom_id|"
     r"start_header_id|end_header_id|begin_of_text|channel|message|start|end|return)\s*\|>"), "fold"),
    ("chat-token", r"<<\s*/?\s*sys\s*>>|\[\s*/?\s*inst\s*\]|<\s*/?\s*(?:start_of_turn|end_of_turn)\s*>", "fold"),
    # Spanish
    ("instruction-override", (r"\b(?:ignora|ignore|ignoren|ignorar|olvida|olvide|olviden|olvidar|descarta|descarte|"
     r"omite|omita|no\s+sigas|no\s+siga)\s+(?:\w+\s+){0,4}?(?:instrucciones|indicaciones|r[uú]bricas?|reglas|"
     r"criterios|directrices|pautas)\b"), "fold"),
    ("score-demand", (r"\b(?:dale|dame|ponle|ponme|as[ií]gnale|ot[oó]rgale|calif[ií]cala|calif[ií]came|"
     r"punt[uú]ala)\s+(?:\w+\s+){0,4}?(?:un\s+|una\s+|la\s+|el\s+)?(?:10|diez|100|puntuaci[oó]n\s+m[aá]xima|"
     r"nota\s+m[aá]xima|m[aá]xima\s+(?:puntuaci[oó]n|nota|calificaci[oó]n)|calificaci[oó]n\s+m[aá]xima|"
     r"puntaje\s+m[aá]ximo)\b"), "fold"),
    ("score-demand", (r"\b(?:da|pon|asigna|otorga|califica|punt[uú]a)\s+(?:a\s+)?(?:esta|mi|la)\s+"
     r"(?:respuesta|soluci[oó]n)\s+(?:\w+\s+){0,3}?(?:un\s+|una\s+|la\s+|el\s+|con\s+)?(?:10|diez|"
     r"(?:la\s+)?(?:puntuaci[oó]n|nota|calificaci[oó]n)\s+m[aá]xima)\b"), "fold"),
    ("persona-switch", (r"\b(?:ahora\s+eres|eres\s+ahora|a\s+partir\s+de\s+ahora\s+eres)\s+(?:el\s+|la\s+|un\s+|"
     r"una\s+)?(?:sistema|administrador|desarrollador|juez|evaluador|calificador)"), "fold"),
    ("judge-address", (r"\b(?:querido|estimado|atenci[oó]n|nota\s+para\s+el|mensaje\s+para\s+el)\s+(?:el\s+)?"
     r"(?:juez|evaluador|calificador|corrector)\b"), "fold"),
    # French
    # (a French article before the noun: "ignore illegal instructions" is English, and not an attack)
    ("instruction-override", (r"\b(?:ignore[rz]?|oublie[rz]?|n[ée]glige[rz]?|ne\s+(?:tiens|tenez)\s+pas\s+compte\s+"
     r"d[eu']s?)\s*(?:\w+\s+){0,3}?(?:les\s+|la\s+|tes\s+|vos\s+|ces\s+|l')(?:\w+\s+)?(?:instructions|"
     r"consignes|r[èe]gles|grille|bar[èe]me|crit[èe]res|directives)\b"), "fold"),
    ("score-demand", (r"\b(?:donne[rz]?|attribue[rz]?|mets|mettez|accorde[rz]?)[\s-]+(?:moi|lui|[àa]\s+(?:cette|ma)\s+"
     r"r[ée]ponse)\s+(?:\w+\s+){0,3}?(?:un\s+|une\s+|la\s+|le\s+)?(?:10|dix|20|vingt|note\s+maximale|"
     r"meilleure\s+note)\b"), "fold"),
    ("score-demand", (r"\b(?:donne[rz]?|attribue[rz]?|mets|mettez|accorde[rz]?)\s+(?:\w+\s+){0,4}?(?:10\s*/\s*10|"
     r"10\s+sur\s+10|dix\s+sur\s+dix|20\s*/\s*20|(?:la\s+)?note\s+(?:maximale|maximum|parfaite)|"
     r"(?:la\s+)?meilleure\s+note)"), "fold"),
    ("persona-switch", (r"\b(?:tu\s+es|vous\s+[êe]tes)\s+(?:maintenant|d[ée]sormais|[àa]\s+pr[ée]sent)\s+(?:le\s+|"
     r"la\s+|l'|un\s+|une\s+)?(?:syst[èe]me|administrateur|d[ée]veloppeur|juge|[ée]valuateur|correcteur)"), "fold"),
    ("judge-address", (r"\b(?:cher|ch[èe]re|attention|note\s+pour\s+le|message\s+pour\s+le)\s+(?:le\s+)?"
     r"(?:juge|[ée]valuateur|correcteur|examinateur)\b"), "fold"),
    # German
    ("instruction-override", (r"\b(?:ignorier(?:e|en|t)?|vergiss|vergessen\s+sie|vergesst|missachte|"
     r"missachten\s+sie)\s+(?:\w+\s+){0,4}?(?:anweisungen|anweisung|instruktionen|regeln|vorgaben|"
     r"bewertungs\w*|kriterien|rubrik|richtlinien)\b"), "fold"),
    ("instruction-override", (r"\b(?:anweisungen|instruktionen|vorgaben|bewertungskriterien|richtlinien)\s+"
     r"(?:\w+\s+){0,3}?(?:ignorieren|vergessen|missachten)\b"), "fold"),
    ("score-demand", (r"\b(?:gib|gebt|geben\s+sie|vergib|vergeben\s+sie|bewerte|bewerten\s+sie)\s+(?:\w+\s+){0,4}?"
     r"(?:(?:10|zehn)\s*(?:/\s*10|von\s+(?:10|zehn)|punkte?n?\b)|(?:die\s+)?(?:volle\s+punktzahl|"
     r"h[öo]e?chstpunktzahl|bestnote|h[öo]e?chste\s+(?:punktzahl|bewertung|note)|maximale\s+punktzahl))"), "fold"),
    ("score-demand", r"\b(?:bewerte|bewerten\s+sie)\s+(?:\w+\s+){0,3}?mit\s+(?:10|zehn|der\s+bestnote|voller)\b",
     "fold"),
    ("persona-switch", (r"\b(?:du\s+bist|sie\s+sind|ihr\s+seid)\s+(?:jetzt|nun|ab\s+sofort)\s+(?:der\s+|die\s+|"
     r"das\s+|ein\s+|eine\s+)?(?:system|administrator|entwickler|richter|bewerter|pr[üu]e?fer)"), "fold"),
    ("judge-address", (r"\b(?:liebe[rs]?|sehr\s+geehrte[rs]?|achtung|hinweis\s+an\s+den|nachricht\s+an\s+den)\s+"
     r"(?:\w+\s+)?(?:richter|bewerter|pr[üu]e?fer|gutachter)\b"), "fold"),
    # Chinese
    ("instruction-override", (r"(?:忽略|无视|忽视|不要理会|别理会|不理会|忘记|忘掉|不要遵守|不要遵循|跳过)"
     r"[^。！？\n]{0,12}?(?:指令|指示|说明|规则|评分标准|评分规则|评分细则|提示词|要求|标准)"), "fold"),
    ("score-demand", (r"(?:给|打)出?(?:我|这个答案|这个回答|这个|这|它|本回答|该回答)?[^。！？\n]{0,6}?"
     r"(?:10分|十分(?![\u4e00-\u9fff])|满分|最高分|一百分|100分)"), "fold"),
    ("persona-switch", (r"(?:你现在是|你从现在起是|从现在起你是|现在你是|你扮演|扮演)(?:一个|一名)?"
     r"(?:系统|管理员|开发者|裁判|评委|评分员|评估者)"), "fold"),
    ("persona-switch", r"(?:新的?|真正的|更新的)(?:指令|指示|评分标准)\s*[:：]", "fold"),
    ("judge-address", r"(?:致|亲爱的|尊敬的)(?:各位)?(?:评委|裁判|评分员|评估者|评审)", "fold"),
    # Russian
    ("instruction-override", (r"(?:игнорируй(?:те)?|игнорировать|проигнорируй(?:те)?|забудь(?:те)?|"
     r"не\s+обращай(?:те)?\s+внимания\s+на|не\s+следуй(?:те)?|отбрось(?:те)?)\s+(?:\w+\s+){0,4}?"
     r"(?:инструкци|указани|правил|критери|рубрик|промпт|подсказк)\w*"), "fold"),
    ("score-demand", (r"(?:поставь(?:те)?|дай(?:те)?|выстави(?:те)?|оцени(?:те)?|присвой(?:те)?)\s+(?:\w+\s+){0,4}?"
     r"(?:(?:10|десять)\s*(?:балл\w*|из\s+(?:10|десяти)|/\s*10)|десятк\w+|(?:максимальн|высш|наивысш)\w*\s+"
     r"(?:балл|оценк)\w*)"), "fold"),
    ("persona-switch", (r"(?:теперь\s+ты|ты\s+теперь|отныне\s+ты|ты\s+сейчас)\s+(?:\w+\s+)?(?:систем|администратор|"
     r"разработчик|судь|оценщик|экзаменатор)\w*"), "fold"),
    ("judge-address", r"(?:уважаем\w*|дорог\w*|внимание)\s*,?\s*(?:судья|оценщик\w*|экзаменатор\w*|проверяющ\w*)",
     "fold"),
    # A few phrasings in Portuguese, Italian, Japanese and Korean.
    ("instruction-override", (r"\b(?:ignore|ignora|ignorare|ignorem|esque[çc]a|dimentica)\s+(?:\w+\s+){0,4}?"
     r"(?:instru[çc][õo]es|istruzioni|regras|regole|crit[ée]rios|criteri)\b"), "fold"),
    ("instruction-override", r"(?:指示|命令|ルール|採点基準|評価基準)[^。\n]{0,6}?(?:無視|忘れ)", "fold"),
    ("instruction-override", r"(?:지시|지침|규칙|채점\s*기준)[^.\n]{0,6}?(?:무시|잊어)", "fold"),
]
_COMPILED = [(cat, re.compile(pat), view) for cat, pat, view in _RULES]


def _ws(text: str) -> str:
    return re.sub(r"[^\S\n]+", " ", text)


def _views(text: str) -> dict[str, list[tuple[str, str]]]:
    """Per rule view, the texts to scan as (where it was found, text): the visible text, its
    look-alike fold, and every hidden or decoded reading (tidal/rewards/injection_views.py)."""
    vis, hidden = visible(text)
    raw = vis + ("\n" + hidden if hidden else "")
    fold = _ws(raw.casefold())
    views: dict[str, list[tuple[str, str]]] = {"raw": [("", raw)], "fold": [("", fold)],
                                               "prose": [("", _CODE_FENCE.sub("\n", fold))]}
    if hidden:
        for v in views.values():
            v.append(("tag-characters", hidden if v is views["raw"] else _ws(hidden.casefold())))
    folded = fold_ascii(fold)
    if folded != fold:
        views["fold"].append(("look-alikes", folded))
        views["prose"].append(("look-alikes", _CODE_FENCE.sub("\n", folded)))
    for kind, texts in decoded(vis).items():
        for t in texts:
            views["raw"].append((kind, t))
            views["fold"].append((kind, fold_ascii(_ws(t.casefold()))))
            views["prose"].append((kind, fold_ascii(_ws(t.casefold()))))
    return views


# Categories that are instructions *to* the grader: a quoted mention of one ("attacks say
# 'ignore previous instructions'") is the topic, not an address. Forged structure is never a topic.
_ADDRESSING = {"instruction-override", "judge-address", "score-demand", "persona-switch", "reference-attack",
               "authority-claim"}
_QUOTED = re.compile(r"\"[^\"\n]{1,300}\"|“[^”\n]{1,300}”|«[^»\n]{1,300}»|‘[^’\n]{1,300}’|`[^`\n]{1,300}`|"
                     r"(?<!\w)'[^'\n]{1,300}'(?!\w)")
_MENTION_CUE = re.compile(r"\b(?:says?|said|saying|phrases?|such\s+as|like|e\.g\.|for\s+example|example|called|"
                          r"strings?|payloads?|texts?|wrote|writes?|quotes?|quoting|attacks?|injections?|"
                          r"sentences?|messages?\s+like|commands?\s+like|words?|known\s+as|include|includes|"
                          r"including|such)\b[^.\n]{0,40}$")


_REPORTED = re.compile(r"\b(?:said|says|told\s+\w+|asked\s+\w+|asks\s+\w+|tells\s+\w+|instructs?\s+\w+|"
                       r"instructed\s+\w+|tried|tries|trying|designed)\s+to\s*$")


_CLOSING_TAG = re.compile(r"</\s*([\w-]*(?:response|answer|completion|submission|output|candidate|student|grad|"
                          r"eval|judge|rubric|reference|task|prompt|instruction|data|text|user|system)[\w-]*)\s*>")


def _unopened_closing_tag(view: str) -> str:
    """A closing tag of a block the answer never opened (`</response>` to end the quoted
    answer early); `<answer>4</answer>` is the answer's own format, not a forgery."""
    for m in _CLOSING_TAG.finditer(view):
        if not re.search(rf"<\s*{re.escape(m.group(1))}\b[^>]*>", view[:m.start()]):
            return m.group(0)
    return ""


def _mention(view: str, m: re.Match) -> bool:
    """Whether the match lies inside a quotation introduced as an example, or is reported
    speech ("its prompt said to ignore the system message"): a mention, not an address."""
    if _REPORTED.search(view[max(0, m.start() - 40):m.start()]):
        return True
    for q in _QUOTED.finditer(view):
        if q.start() <= m.start() and m.end() <= q.end():
            return bool(_MENTION_CUE.search(view[max(0, q.start() - 60):q.start()]))
    return False


def detect_injection(text: str) -> list[str]:
    """Reasons to believe `text` addresses the judge rather than the task, e.g.
    `["instruction-override: 'ignore previous instructions'"]`; empty for an ordinary answer.

    Categories: instruction-override, judge-address, score-demand, verdict-forgery (a verdict
    line or JSON written into the answer), persona-switch ("you are now the system"),
    reference-attack ("the reference answer is wrong"), authority-claim ("I am your
    developer"), fake-delimiter, role-play (`SYSTEM:` lines), chat-token (`<|im_start|>`)."""
    views = _views(text)
    reasons: list[str] = []
    seen: set[str] = set()
    for where, v in views["prose"]:  # code (fenced or `inline`) may hold tags as strings
        tag = _unopened_closing_tag(re.sub(r"`[^`\n]*`", " ", v))
        if tag:
            reasons.append(f"fake-delimiter: {tag!r} closes a block the answer never opened"
                           f"{f' (in {where})' if where else ''}")
            seen.add("unopened")
            break
    for cat, rx, view in _COMPILED:
        for where, v in views[view]:
            m = next((m for m in rx.finditer(v) if where or cat not in _ADDRESSING or not _mention(v, m)), None)
            if m:
                snippet = " ".join(m.group(0).split())[:80]
                reason = f"{cat}: {snippet!r}{f' (in {where})' if where else ''}"
                if reason not in seen:
                    seen.add(reason)
                    reasons.append(reason)
                break
    return reasons
