"""The held-out general-chat set: everyday requests, asked as one-turn chats, for measuring how
much of the drafters' acceptance holds off the code domain (`bench accept --dataset chat`).

Written for this module and kept apart from the training corpora (`train/corpus.py`, whose
requests are other ones: a test checks the two never share a request by `same_request`, which
the general-chat training corpus, `train/chat.py`, applies to every request it keeps), so no
drafter is ever trained on them. Emails, explanations, lists, advice, stories, summaries, word problems and
small rewrites: the mix of what people ask a chat assistant, with no code.
"""

from __future__ import annotations

import re

GENERAL_CHAT = (
    "Write a note to my son's teacher saying he will miss school on Thursday for a dentist appointment.",
    "Why does bread go stale, and how can I keep it fresh for longer?",
    "What should I bring to a picnic at the beach with four friends?",
    "Explain what a pension fund is and how it grows over the years.",
    "Write a birthday message for my grandmother, who is turning ninety.",
    "What is the difference between a comet and an asteroid?",
    "Suggest a theme and decorations for a retirement party at the office.",
    "How do noise-cancelling headphones work?",
    "Write a four-line poem about a city at night.",
    "My tomato plants have yellow leaves. What could be wrong, and what should I do?",
    "Retell the legend of King Arthur and the sword in the stone in one paragraph.",
    "How does a microwave oven heat food?",
    "Draft an email to my team saying the Friday meeting is moved to Monday at 10 am.",
    "What should I look for when buying a second-hand bicycle?",
    "Describe the life cycle of a butterfly.",
    "A shop sells apples at 3 for $1.20. How much do 10 apples cost?",
    "Give me tips for sleeping better when I have to get up early.",
    "Why do onions make people cry when they are cut?",
    "Write a short apology to a friend for missing their party.",
    "What are the main causes of the French Revolution?",
    "Plan a simple vegetarian dinner menu for six guests.",
    "How does a credit score work, and how can I improve mine?",
    "Write a fable, about 150 words, about a tortoise who wants to fly.",
    "What is the difference between an introvert and an extrovert?",
    "List some ways to reduce plastic waste at home.",
    "Explain how elections work in a parliamentary system.",
    "Rewrite this sentence to sound more formal: we can't make it to the meeting, sorry.",
    "What are the health benefits of walking every day?",
    "A cyclist rides 45 km in 2.5 hours. What is her average speed, and how far does she go in 4 hours at that pace?",
    "What are stem cells, and why are they important in medicine?",
    "Write a short speech to welcome new students on their first day of school.",
    "What are some good questions to ask at the end of a job interview?",
    "How are earthquakes measured, and what do the numbers mean?",
    "Give me a beginner's weekly running plan to reach five kilometres.",
    "Explain the rules of chess in simple terms.",
    "Write a review of a cosy Italian restaurant with great pasta but slow service.",
    "Why do we have time zones?",
    "How can I keep my houseplants alive in winter?",
    "Summarise the main arguments for and against school uniforms.",
    "Write a letter to a pen pal describing my home town.",
    "What is ocean acidification and why does it matter?",
    "Three friends share a restaurant bill of $84 and leave a 15% tip. How much does each pay?",
    "How do submarines dive and come back up to the surface?",
    "Give me ideas for a fun team-building activity at work.",
    "What were the main achievements of the Roman Empire?",
    "Write a ghost story for children that is spooky but not too scary.",
    "How should I prepare for my first marathon?",
    "Explain what happens in the body when we catch a cold.",
    "Write a text message inviting friends to a board game night on Saturday.",
    "What are the pros and cons of social media for teenagers?",
    "Describe the main features of Gothic architecture.",
    "How do I make a budget for my monthly expenses?",
    "Explain how the moon causes tides.",
    "Write a motivational message for someone who failed an exam.",
    "What is the best way to learn a new language as an adult?",
    "A bakery makes 240 rolls a day and sells 85% of them. How many are left over in a five-day week?",
    "Explain what an economic recession is.",
    "Suggest a reading list of five classic novels for a teenager, with a line about each.",
    "How do bees make honey?",
    "Write the introduction of a talk about the history of the printing press.",
    "What are some simple ways to save energy at home?",
    "What does it mean to be a good listener? Give some practical advice.",
    "Write a complaint email about a parcel that arrived damaged.",
    "Why do cats purr?",
)
"""64 requests, none in the training corpus."""


def general_chat_messages() -> list[list[dict[str, str]]]:
    """Each request as a one-turn chat (the shape `humaneval_messages` gives)."""
    return [[{"role": "user", "content": text}] for text in GENERAL_CHAT]


COMMON = frozenset("a an and are as at be by do does for from give how i in is it its me my of on or some that the "
                   "their them they this to was what when which who why will with write you your".split())
"""Words that say nothing of what a request is about."""


def content_words(text: str) -> frozenset[str]:
    """The lower-case words of a request less the common ones: what it is about."""
    return frozenset(re.findall(r"[a-z]+", text.lower())) - COMMON


def same_request(a: str, b: str) -> bool:
    """Most of their content words shared: the same request in other words (what keeps a
    training request apart from every held-out one)."""
    x, y = content_words(a), content_words(b)
    return len(x & y) >= 0.5 * len(x | y)
