"""Word lists for the writing rewards: transition phrases by category, and English stopwords.

Written for this project. Phrases are matched as whole words (see ``text.py``), so short
connectives such as "so" or "as" are safe to list: they no longer match inside "also" or "was",
which is the substring-matching flaw of the reference implementation.
"""

TRANSITION_CATEGORIES: dict[str, tuple[str, ...]] = {
    "elaboration": ("furthermore", "moreover", "in addition", "additionally", "besides",
                    "what is more", "also", "likewise", "further"),
    "example": ("for example", "for instance", "such as", "namely", "to illustrate",
                "in particular", "specifically", "e.g."),
    "explanation": ("in other words", "that is", "that is to say", "put differently",
                    "to put it simply", "i.e.", "this means"),
    "cause_effect": ("because", "therefore", "thus", "hence", "consequently", "as a result",
                     "due to", "so that", "accordingly", "since"),
    "contrast": ("however", "but", "on the other hand", "in contrast", "nevertheless",
                 "nonetheless", "whereas", "yet", "instead", "conversely"),
    "sequence": ("first", "firstly", "second", "secondly", "third", "next", "then",
                 "finally", "subsequently", "lastly", "to begin with"),
    "emphasis": ("indeed", "in fact", "above all", "notably", "especially", "clearly",
                 "importantly", "certainly"),
    "summary": ("in summary", "in conclusion", "to sum up", "overall", "in short",
                "in brief", "to conclude", "all in all"),
    "comparison": ("similarly", "in the same way", "just as", "compared to",
                   "compared with", "likewise", "equally"),
    "concession": ("although", "even though", "though", "admittedly", "despite",
                   "in spite of", "granted", "even so"),
    "condition": ("if", "unless", "provided that", "as long as", "in case", "otherwise",
                  "assuming that"),
    "time": ("meanwhile", "afterwards", "later", "eventually", "previously",
             "at the same time", "until", "when", "while", "before", "after"),
}

STOPWORDS: frozenset[str] = frozenset(
    """
    a about above after again against all am an and any are as at be because been before
    being below between both but by can could did do does doing down during each few for from
    further had has have having he her here hers herself him himself his how i if in into is it
    its itself just me more most my myself no nor not now of off on once only or other our ours
    ourselves out over own same she should so some such than that the their theirs them
    themselves then there these they this those through to too under until up very was we were
    what when where which while who whom why will with would you your yours yourself
    yourselves also may might must shall us s t don didn doesn isn wasn weren won wouldn ll ve
    re m d
    """.split()
)
