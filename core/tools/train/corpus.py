"""The prompt corpus for self-distilling drafters: one-turn chats for the target to answer.

Drafters learn to predict what the target model says, so they should see the kind of text they
will draft at evaluation time. The evaluation set is HumanEval (164 Python function stubs asked
as chat, see `datasets.humaneval_messages`), and it must never leak into training, neither its
prompts nor its problems. So the corpus is made from two sources that are not HumanEval:

* stubs of functions from the Python standard library that ships with the running interpreter
  (`def name(args) -> ann:` and the docstring, no body): the same shape as a HumanEval prompt,
  taken from code nobody wrote for a benchmark. About half are asked with the HumanEval phrasing
  ("Complete this Python function."), the rest with other phrasings, so the drafters are not
  tied to one wording. Functions that share a name with a HumanEval entry point are left out.
* optionally, stubs of the functions of installed packages (`--package numpy --package sympy ...`),
  chosen the same way: code written for libraries, not benchmarks, in far greater number and
  variety than the stdlib alone (about 2,500 stubs). A corpus with packages depends on their
  versions, which `main` prints.
* hand-written requests (`INSTRUCTIONS`), written for this module: programming (functions,
  classes, bugs, SQL, shell, regex, algorithms, tests) and general (explanations, summaries,
  stories, emails, word problems), chosen to avoid the HumanEval problems. When a corpus needs
  more of them than there are, they come back with a different opening or closing sentence.

The default mix is about 75% code (stubs 65%, programming requests 10%) and 25% general
(`--general-share`, `--programming-share`). A corpus is deterministic for a seed, an interpreter
version (the stubs come from its stdlib) and the versions of the packages it draws on.

    python -m speckernel.tools.train.corpus --out corpus.jsonl.gz --count 8000 [--seed 0] [--package NAME ...]
"""

from __future__ import annotations

import argparse
import ast
import functools
import gzip
import importlib.metadata
import importlib.util
import io
import json
import os
import random
import re
import sys
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

Conversation = list[dict[str, str]]

GENERAL_SHARE = 0.25
PROGRAMMING_SHARE = 0.10  # hand-written programming requests; stubs are the rest of the code share

MIN_DOCSTRING = 40
MAX_DOCSTRING = 2000  # longer docstrings are manuals, not function descriptions
PACKAGE_MAX_DOCSTRING = 1200  # library docstrings run long; a prompt should leave room for its answer
PER_PACKAGE = 2500  # stubs from one package at most, so a few big ones do not make up the corpus
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "tkinter", "lib2to3", "ensurepip", "site-packages",
                       "dist-packages", "turtledemo", "__pycache__"})

# The 164 HumanEval entry points: a stub with one of these names is left out, so that no training
# prompt asks for a function the evaluation asks for. (Names only, used to exclude; the test
# checks this set against the real data when it is cached.)
HUMANEVAL_ENTRY_POINTS = frozenset("""
Strongest_Extension add add_elements all_prefixes anti_shuffle any_int below_threshold below_zero bf
by_length can_arrange car_race_collision change_base check_dict_case check_if_last_char_is_a_letter
choose_num circular_shift closest_integer common compare compare_one concatenate correct_bracketing
count_distinct_characters count_nums count_up_to count_upper cycpattern_check decimal_to_binary
decode_cyclic decode_shift derivative digitSum digits do_algebra double_the_difference eat encode
encrypt even_odd_count even_odd_palindrome exchange f factorize fib fib4 fibfib file_name_check
filter_by_prefix filter_by_substring filter_integers find_closest_elements find_max find_zero
fix_spaces fizz_buzz flip_case fruit_distribution generate_integers get_closest_vowel get_max_triples
get_odd_collatz get_positive get_row greatest_common_divisor has_close_elements hex_key histogram
how_many_times incr_list int_to_mini_roman intersection intersperse is_bored is_equal_to_sum_even
is_happy is_multiply_prime is_nested is_palindrome is_prime is_simple_power is_sorted iscube
largest_divisor largest_prime_factor largest_smallest_integers longest make_a_pile make_palindrome
match_parens max_element max_fill maximum mean_absolute_deviation median minPath minSubArraySum modp
monotonic move_one_ball multiply next_smallest numerical_letter_grade odd_count order_by_points
pairs_sum_to_zero parse_music parse_nested_parens pluck prime_fib prime_length prod_signs
remove_duplicates remove_vowels rescale_to_unit reverse_delete right_angle_triangle rolling_max
rounded_avg same_chars search select_words separate_paren_groups simplify skjkasdkd smallest_change
solution solve sort_array sort_even sort_numbers sort_third sorted_list_sum specialFilter
special_factorial split_words starts_one_ends strange_sort_list string_sequence string_to_md5
string_xor strlen sum_product sum_squares sum_to_n total_match tri triangle_area triples_sum_to_zero
truncate_number unique unique_digits valid_date vowels_count will_it_fly words_in_sentence
words_string x_or_y
""".split())

HUMANEVAL_TEMPLATE = "Complete this Python function.\n\n```python\n{stub}```"
STUB_TEMPLATES = (
    HUMANEVAL_TEMPLATE,
    "Implement the following Python function.\n\n```python\n{stub}```",
    "Implement `{name}` so that it does what its docstring says.\n\n```python\n{stub}```",
    "Write the body of this function and reply with the complete function.\n\n```python\n{stub}```",
    "Explain what this function does, based on its signature and docstring, then write a possible "
    "implementation.\n\n```python\n{stub}```",
    "Here is a function stub from a Python module:\n\n```python\n{stub}```\n\nFill in the missing code.",
)

PROGRAMMING_INSTRUCTIONS = (
    "Write a Python function that flattens an arbitrarily nested list of integers into a flat list.",
    "Write a Python class `LRUCache` with `get` and `put` methods that both run in O(1), using "
    "`collections.OrderedDict`.",
    "Explain what this line does:\n\n```python\ntop = {k: v for k, v in sorted(counts.items(), "
    "key=lambda kv: -kv[1])[:3]}\n```",
    "Why does calling this function twice return a list with two items the second time? Fix it.\n\n"
    "```python\ndef append_item(item, items=[]):\n    items.append(item)\n    return items\n```",
    "Write an SQL query that returns, for every department, the employee with the highest salary. "
    "Tables: employees(id, name, department_id, salary) and departments(id, name).",
    "Give me a bash one-liner that finds all files larger than 100 MB under the current directory "
    "and prints them sorted by size.",
    "Write a regular expression that matches a time in 24-hour HH:MM format, and explain each part of it.",
    "Implement iterative binary search over a sorted Python list. Return the index of the target, or -1.",
    "Implement a singly linked list in Python with `push_front`, `pop_front` and `reverse` methods.",
    "Write pytest tests for `slugify(title: str) -> str`, which lowercases a title, replaces every run "
    "of non-alphanumeric characters with a single hyphen, and strips hyphens from both ends.",
    "What is the difference between a list and a tuple in Python? When should I use each one?",
    "Write a Python generator that reads a large text file and yields its lines in batches of N.",
    "Implement Dijkstra's shortest-path algorithm in Python with `heapq`. The graph is a dict that maps "
    "each node to a list of (neighbour, weight) pairs.",
    "Write a function that topologically sorts a dependency graph and raises a clear error when the "
    "graph has a cycle.",
    "Explain Big-O notation with examples of O(1), O(log n), O(n) and O(n^2) operations on Python "
    "data structures.",
    "This JavaScript prints 3 three times instead of 0, 1, 2. Why, and how do I fix it?\n\n"
    "```javascript\nfor (var i = 0; i < 3; i++) {\n  setTimeout(() => console.log(i), 100);\n}\n```",
    "Write a Python decorator `retry(times, delay)` that calls the wrapped function again when it "
    "raises, waiting `delay` seconds between attempts.",
    "Write a Python context manager that prints how long the code inside the `with` block took.",
    "Write a Python dataclass `Invoice` holding line items (description, quantity, unit price) with "
    "a method that returns the total including a tax rate.",
    "Write an SQL query that lists the customers who never placed an order. Tables: customers(id, name), "
    "orders(id, customer_id, created_at).",
    "Implement run-length encoding and decoding in Python, for example \"aaabcc\" <-> \"a3b1c2\".",
    "Write a Python function that splits a list into chunks of size n. The last chunk may be shorter.",
    "Transpose a matrix given as a list of lists in Python, without numpy.",
    "Explain the difference between `git merge` and `git rebase`, and when to use each.",
    "Write a shell script that backs up a directory into a timestamped .tar.gz archive and deletes "
    "backups older than seven days.",
    "Implement an evaluator for Reverse Polish Notation expressions using a stack, e.g. "
    "\"3 4 + 2 *\" gives 14.",
    "Write a Python function that merges two sorted lists into one sorted list in linear time.",
    "Implement a trie in Python with `insert`, `contains` and `words_with_prefix` methods.",
    "What does `yield from` do in Python? Show a small example.",
    "Write a regex that extracts all hashtags from a tweet, such as #python or #100DaysOfCode.",
    "This should return the last n items but returns one too many. Fix it:\n\n```python\n"
    "def last_n(items, n):\n    return items[len(items) - n - 1:]\n```",
    "Write a function that validates an IPv4 address string without using the `ipaddress` module.",
    "Turn this loop into a list comprehension:\n\n```python\nsquares = []\nfor x in range(20):\n"
    "    if x % 3 == 0:\n        squares.append(x * x)\n```",
    "Write a Python script that reads sales.csv (columns: date, region, amount) and prints the total "
    "amount per region, largest first.",
    "What is a race condition? Show a Python threading example that has one, then fix it with a lock.",
    "Given a maze as a list of strings where '#' is a wall and '.' is open, use breadth-first search to "
    "find the length of the shortest path from the top-left to the bottom-right cell.",
    "Write a Rust struct `Temperature` that converts between Celsius and Fahrenheit and implements "
    "the `Display` trait.",
    "Write a Python function that computes the Levenshtein edit distance between two strings.",
    "Explain the difference between processes and threads, and what the GIL means for Python programs.",
    "Write a Python class `Matrix` that supports addition, multiplication by another matrix, and "
    "readable printing.",
    "What is SQL injection? Show a vulnerable Python snippet using sqlite3, then the safe version.",
    "Write `deep_merge(a, b)` in Python: merge two nested dictionaries, with values from b winning.",
    "Implement quicksort in Python and explain how the choice of pivot affects performance.",
    "Implement a min-heap class in Python from scratch (no heapq) with `push`, `pop` and `peek`.",
    "Write unittest tests for a `ShoppingCart` class with `add_item`, `remove_item` and `total` methods.",
    "Write a Python function that parses a duration such as \"1h30m15s\" or \"45s\" into seconds.",
    "Explain what this regex matches: `^(?=.*\\d)(?=.*[a-z])(?=.*[A-Z]).{8,}$`",
    "Write a Go HTTP server with a /health endpoint that returns the JSON {\"status\": \"ok\"}.",
    "Write an SQL query for the 7-day moving average of daily revenue from sales(day DATE, revenue NUMERIC).",
    "Write an async Python function that downloads a list of URLs concurrently with asyncio and aiohttp, "
    "never more than five at a time.",
    "Why is `0.1 + 0.2 == 0.3` False in Python, and how should floating-point numbers be compared?",
    "Write a function that rotates an n x n matrix 90 degrees clockwise in place.",
    "Implement a rate limiter class in Python using the token bucket algorithm.",
    "Write a shell pipeline that counts how many times each HTTP status code appears in an nginx "
    "access log.",
    "Refactor this function so it is readable and idiomatic:\n\n```python\ndef clean(d):\n r=[]\n"
    " for k in d:\n  if d[k]!=None and d[k]!='' : r.append((k,d[k]))\n return dict(r)\n```",
    "Implement a union-find (disjoint set) structure with path compression and union by rank.",
    "Write a recursive Python function that returns all permutations of a list, without itertools.",
    "Explain the difference between `is` and `==` in Python, with examples where they disagree.",
    "Write a Python command-line script with argparse that takes an input file, an optional --output "
    "file and a --verbose flag.",
    "Write a function that turns a nested dict into a flat dict with dotted keys, so {\"a\": {\"b\": 1}} "
    "becomes {\"a.b\": 1}.",
    "Explain encapsulation, inheritance, polymorphism and abstraction with short Python examples.",
    "Write a JavaScript `debounce(fn, ms)` function and explain when you would use it.",
    "Write the SQL to create a table of blog posts: an auto-increment id, a title, a body, an author id "
    "that references users, and a creation timestamp.",
    "Implement a FIFO queue using two stacks in Python and explain its amortised cost.",
    "What is the difference between a shallow copy and a deep copy? Demonstrate with `copy.copy` and "
    "`copy.deepcopy`.",
    "Detect a cycle in a singly linked list with Floyd's tortoise and hare algorithm, in Python.",
    "Write a Python function that formats a byte count for humans, e.g. 1536 -> \"1.5 KiB\".",
    "This raises `RuntimeError: dictionary changed size during iteration`. Fix it.\n\n```python\n"
    "for key in settings:\n    if settings[key] is None:\n        del settings[key]\n```",
    "Write a regex that validates UK postcodes, and say which cases it does not cover.",
    "Write a small command-line TODO app in Python that keeps its items in a JSON file and supports "
    "add, list and done.",
    "What are `__init__`, `__repr__` and `__eq__` for? Show them in one small class.",
    "Write a C function that reverses a null-terminated string in place.",
    "Write a Python function that returns the k most frequent elements of a list, using heapq.",
    "Solve the coin change problem with dynamic programming: the fewest coins that make a given amount, "
    "or -1 if it cannot be made.",
    "Write a Python function that returns the longest common subsequence of two strings (the "
    "subsequence itself, not only its length).",
    "How do I create a Python virtual environment, install packages into it, and write a "
    "requirements file?",
    "Write a Dockerfile for a small Flask app that listens on port 8000.",
    "Write a Python function that checks whether a partly filled 9x9 Sudoku board (0 for empty) "
    "breaks any rule so far.",
    "Write a function that returns the power set of a list of distinct elements.",
    "What does this command do, step by step?\n\n```sh\nfind . -name '*.log' -mtime +30 -print0 | "
    "xargs -0 rm -f\n```",
    "Write a Python function that loads a JSON config file and fills in missing keys from a dict of "
    "defaults, including nested ones.",
    "Implement an event emitter class in Python with `on`, `off` and `emit` methods.",
    "Write an SQL query that ranks products by total sales within each category, using a window function.",
    "Explain how a hash table works inside: hashing, collisions and resizing.",
    "Write a Python function that wraps text to a given width without splitting words, without using "
    "the textwrap module.",
    "This test fails. Find the bug.\n\n```python\ndef average(values):\n    total = 0\n"
    "    for v in values:\n        total += v\n    return total / len(values) - 1\n\n\n"
    "def test_average():\n    assert average([2, 4, 6]) == 4\n```",
    "Write a Python class `Vector2` with addition, subtraction, scalar multiplication, a `length` "
    "method and a helpful `__repr__`.",
    "Given meetings as (start, end) pairs, return the largest number of meetings that do not overlap. "
    "Explain why the greedy choice works.",
    "Write a TypeScript interface for a user profile and a type guard that checks an unknown value "
    "against it.",
    "Explain the difference between GET and POST, and when an API should use PUT, PATCH or DELETE.",
    "Write Python functions that convert snake_case to camelCase and back.",
    "Write a Python script that renames every .jpeg file in a folder to .jpg, with a --dry-run option.",
    "Implement a Bloom filter in Python with a configurable bit array size and number of hash functions.",
    "Why is this so slow for large inputs, and how can it be made fast?\n\n```python\ndef paths(r, c):\n"
    "    return 1 if r == 0 or c == 0 else paths(r - 1, c) + paths(r, c - 1)\n```",
    "Write a regular expression with named groups that captures year, month and day from ISO dates "
    "such as 2024-03-15.",
    "Explain Python slicing, including negative indices and steps, with examples.",
    "Write a function that computes the exponential moving average of a list of prices with a "
    "smoothing factor alpha.",
    "Write a minimal Flask REST API for a list of books, with endpoints to list, add and delete books.",
    "Write a bash loop that pings every host listed in hosts.txt and reports the ones that do not answer.",
    "Implement A* search on a 2D grid in Python with the Manhattan distance as the heuristic.",
    "With pandas, group a DataFrame of orders by month and compute the total and average order value.",
    "What is the difference between an abstract base class and a `typing.Protocol` in Python?",
    "Write a Python function that divides two numbers and logs a warning instead of crashing when the "
    "divisor is zero.",
    "Print a calendar for the current month in Python without importing the calendar module.",
    "Explain recursion using the example of walking a directory tree.",
    "Write a class `Stopwatch` with `start`, `stop`, `reset` and an `elapsed` property.",
    "Write a SQL query that finds duplicate email addresses in a users table and how often each appears.",
    "How do Python's `*args` and `**kwargs` work? Show a function that forwards them to another one.",
    "Write a simple tokenizer in Python that splits an arithmetic expression like \"12*(3+4)\" into "
    "numbers, operators and parentheses.",
    "Write a Python function that returns the n-th row of Pascal's triangle.",
    "What's wrong with this?\n\n```python\nwith open('data.txt') as f:\n    lines = f.readlines\n"
    "print(len(lines))\n```",
)

GENERAL_INSTRUCTIONS = (
    "Explain in simple terms how vaccines train the immune system.",
    "Summarise the causes of the First World War in five bullet points.",
    "List ten ideas for a rainy-day activity with children at home.",
    "Compare renting and buying a home. What are the pros and cons of each?",
    "Write a short story, about 200 words, about a lighthouse keeper who finds a message in a bottle.",
    "Write a polite email to my landlord asking for the broken heating to be repaired this week.",
    "A train leaves at 2:15 pm and travels 180 km at 60 km/h. When does it arrive?",
    "What is the difference between weather and climate?",
    "Explain photosynthesis to a ten-year-old.",
    "Plan a three-day itinerary for a first visit to Lisbon.",
    "Write a haiku about the first snow of winter.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Sarah buys 3 notebooks at $2.40 each and a pen for $1.15. She pays with a $10 bill. How much "
    "change does she get?",
    "What are the main differences between crocodiles and alligators?",
    "Write the opening paragraph of a cover letter for a junior data analyst position.",
    "Explain inflation, and why central banks raise interest rates to fight it.",
    "Name five of the largest moons in the solar system, with one interesting fact about each.",
    "How do I politely decline a wedding invitation? Write a short message I could send.",
    "Compare electric cars and petrol cars on purchase cost, running cost, maintenance and environmental "
    "impact.",
    "Write a limerick about a cat who learned to use a computer.",
    "A recipe needs 250 g of flour for 4 people. How much flour do I need for 10 people?",
    "What causes the seasons on Earth?",
    "Give me practical tips for preparing for a job interview.",
    "Explain the difference between a virus and a bacterium.",
    "Write a short bedtime story about a shy dragon who wants to make friends.",
    "Summarise the main ideas of Stoic philosophy.",
    "What is compound interest? Show how $1,000 grows at 5% a year over three years.",
    "Write a thank-you note to a colleague who helped me finish a difficult project.",
    "Explain how a bill becomes a law in the United States.",
    "List eight healthy breakfasts that take less than ten minutes to make.",
    "A rectangle is twice as long as it is wide and its perimeter is 36 cm. What is its area?",
    "Describe the water cycle.",
    "What are the advantages and disadvantages of working from home?",
    "Write a product description for a reusable stainless-steel water bottle.",
    "What is a black hole, and how do astronomers detect one?",
    "Tom is 4 years older than his sister. In 6 years the sum of their ages will be 40. How old are "
    "they now?",
    "Compare the Roman Republic with the Roman Empire.",
    "Write a short poem about the sea at night.",
    "What are some good ways to reduce stress during exams?",
    "Summarise the story of the Odyssey.",
    "Write an email to a customer apologising for a delayed order and offering a 10% discount.",
    "Explain the difference between \"affect\" and \"effect\", with examples.",
    "What is the difference between a simile and a metaphor?",
    "How does a refrigerator keep food cold?",
    "Make a packing list for a weekend camping trip.",
    "A shop reduces an $80 jacket by 25%, and then by another 10%. What is the final price?",
    "Write a dialogue between a robot and a gardener about why flowers need sunlight.",
    "Explain supply and demand with an everyday example.",
    "What were the main achievements of the Apollo programme?",
    "List the steps to fix a flat tyre on a bicycle.",
    "Write an encouraging message for a friend who starts a new job on Monday.",
    "What is the difference between correlation and causation? Give two examples.",
    "In plain language, how does a message travel across the internet from one computer to another?",
    "Write a short mystery story under 300 words that ends with a twist.",
    "My car uses 6 litres of fuel per 100 km. How much fuel does a 450 km trip need, and what does it "
    "cost at 1.80 euros per litre?",
    "Cat or dog: which is the better pet for someone who lives in a small flat and works long hours?",
    "Summarise the benefits of regular exercise.",
    "Write a formal complaint letter about noise from a construction site near my home.",
    "What is DNA, and how does it store information?",
    "Suggest five names for a small bakery that specialises in sourdough bread.",
    "What is the greenhouse effect?",
    "How should I structure a persuasive essay?",
    "Three friends share a pizza cut into 12 slices. Ana eats a third of it, Ben eats a quarter, and "
    "Carla eats 3 slices. How many slices are left?",
    "Briefly explain the rules of chess to a complete beginner.",
    "Write a toast for my parents' 30th wedding anniversary.",
    "What are the main spelling differences between British and American English?",
    "How does a volcano form, and why does it erupt?",
    "Any advice for an adult who is learning to play the guitar?",
    "Write a short fable with a moral about patience.",
    "Summarise the theory of evolution by natural selection.",
    "A tank holds 1,200 litres. It fills at 40 litres per minute but leaks 10 litres per minute. How "
    "long does it take to fill from empty?",
    "Write a LinkedIn post announcing that I finished a course in project management.",
    "What is the difference between an epidemic and a pandemic?",
    "How do credit scores work?",
    "List some common logical fallacies, with an example of each.",
    "Describe an autumn forest using all five senses.",
    "Compare tea and coffee: caffeine, taste and culture.",
    "How do aeroplanes stay in the air?",
    "Write an out-of-office reply for a two-week holiday.",
    "What led to the fall of the Berlin Wall, and what followed?",
    "Make a simple weekly meal plan for a vegetarian on a tight budget.",
    "A cyclist rides 6 km uphill at 12 km/h and back down the same road at 36 km/h. What is the "
    "average speed for the whole trip?",
    "What is the difference between a democracy and a republic?",
    "Write a short science-fiction story about the first day of school on Mars.",
    "How can I fall asleep faster?",
    "Write a polite reminder to a client about an invoice that is two weeks overdue.",
    "Explain the placebo effect.",
    "What should I look for when choosing a laptop for university?",
    "Summarise the life of Marie Curie in one paragraph.",
    "Write a short speech to open a school sports day.",
    "How many minutes are there in a leap year? Show your working.",
    "What are renewable energy sources? Compare solar and wind power.",
    "Write a riddle and give its answer.",
    "What is a recession, and how is it different from a depression?",
    "Describe three famous paintings and explain why each one matters.",
    "I have 40 minutes to make dinner, and I have eggs, spinach, potatoes and cheese. What can I cook?",
    "Write a short review of an imaginary restaurant that only serves soup.",
    "What is the difference between empathy and sympathy?",
    "A class of 30 students is 40% girls. How many boys are there? If 3 more girls join, what "
    "percentage of the class are girls?",
    "Why is the sky blue?",
    "Write a note asking my neighbour to water my plants while I am away for a week.",
    "What are the main differences between mitosis and meiosis?",
    "Give five tips for writing clear emails at work.",
    "Rewrite this more formally: \"hey, can u send me the report asap? thx\"",
    "Translate \"Where is the nearest train station?\" into French, Spanish and German.",
    "Why do leaves change colour in autumn?",
    "Explain what a mortgage is and how the monthly payment is worked out.",
)

INSTRUCTIONS = PROGRAMMING_INSTRUCTIONS + GENERAL_INSTRUCTIONS

# A reused request gets one of these around it, so each use is a different prompt.
OPENINGS = ("", "Hi! ", "Hello. ", "Quick question. ", "Can you help me with this? ", "I have a task for you. ",
            "Please help. ", "Good morning! ", "I'm stuck on something. ")
CLOSINGS = ("", "Keep it short.", "Please be thorough.", "Explain your reasoning step by step.",
            "Use Markdown formatting.", "Assume I am a beginner.", "I'm in a hurry, so be brief.",
            "Thanks in advance!", "Give an example as well.", "Answer in under 150 words.",
            "Use bullet points where it helps.", "Please double-check your answer.",
            "Write it in a friendly tone.", "End with a one-sentence summary.")


def python_files(root: str | os.PathLike[str]) -> Iterator[Path]:
    """The .py files under root in sorted order (tests and GUI/tooling packages left out), so the
    stubs come out the same on every run."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            if name.endswith(".py") and not name.startswith("test_"):
                yield Path(folder) / name


def stdlib_files(root: str | None = None) -> Iterator[Path]:
    return python_files(root or sysconfig.get_paths()["stdlib"])


_LOGIC = (ast.BoolOp, ast.BinOp, ast.Compare, ast.IfExp, ast.ListComp, ast.SetComp, ast.DictComp,
          ast.GeneratorExp)


def _body_is_trivial(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Nothing to implement after the docstring: no statement, or a single one that is not a
    `return` of some logic (pass, `...`, a raise, a getter, a plain delegating call)."""
    body = node.body[1:]
    if sum(isinstance(n, ast.stmt) for s in body for n in ast.walk(s)) >= 2:
        return False
    if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
        return not any(isinstance(n, _LOGIC) for n in ast.walk(body[0].value))
    return True


def _clean_docstring(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The docstring as `ast.get_docstring` cleans it, less trailing spaces and blank lines (which
    Python 3.11's cleaning leaves in some docstrings)."""
    doc = ast.get_docstring(node, clean=True)
    return None if doc is None else "\n".join(line.rstrip() for line in doc.split("\n")).rstrip("\n")


def _quote_docstring(doc: str) -> str:
    """The docstring as a triple-quoted literal indented for a function body, HumanEval-style
    (closing quotes on their own line when it spans lines)."""
    prefix = "r" if "\\" in doc else ""
    lines = doc.split("\n")
    if len(lines) == 1 and not doc.endswith(('"', "\\")):
        return f'    {prefix}"""{doc}"""\n'
    body = "\n".join(f"    {line}" if line else "" for line in lines)
    return f'    {prefix}"""{body.lstrip()}\n    """\n'


def render_stub(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """`def name(args) -> ann:` and the docstring, or None when the docstring cannot be written
    back exactly (it contains triple quotes or control characters)."""
    doc = _clean_docstring(node)
    if doc is None or '"""' in doc or any(not (c.isprintable() or c == "\n") for c in doc):
        return None
    keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    stub = f"{keyword} {node.name}({ast.unparse(node.args)}){returns}:\n{_quote_docstring(doc)}"
    try:
        parsed = ast.parse(stub + "    pass\n").body[0]
    except SyntaxError:
        return None
    if not isinstance(parsed, ast.FunctionDef | ast.AsyncFunctionDef) or _clean_docstring(parsed) != doc:
        return None
    return stub


def _candidates(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Top-level functions and the methods of top-level public classes."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from (m for m in node.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef))


def _keep(node: ast.FunctionDef | ast.AsyncFunctionDef, max_docstring: int = MAX_DOCSTRING) -> bool:
    doc = _clean_docstring(node) or ""
    return (not node.name.startswith("_") and node.name.lower() not in _BLOCKED_NAMES
            and MIN_DOCSTRING <= len(doc) <= max_docstring and not _body_is_trivial(node))


_BLOCKED_NAMES = frozenset(name.lower() for name in HUMANEVAL_ENTRY_POINTS)
# A definition of an entry point anywhere in a stub (docstring examples define helpers too).
_DEFINES_BLOCKED = re.compile(
    rf"^\s*(?:async\s+)?def\s+(?:{'|'.join(sorted(map(re.escape, HUMANEVAL_ENTRY_POINTS)))})\s*\(", re.M | re.I)


def _stubs_in(files: Iterator[Path], max_docstring: int = MAX_DOCSTRING) -> tuple[str, ...]:
    """The distinct stubs of the kept functions in files, in file order."""
    stubs: dict[str, None] = {}
    for path in files:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escapes and the like in old modules
                tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue
        for node in _candidates(tree):
            if _keep(node, max_docstring) and (stub := render_stub(node)) is not None \
                    and not _DEFINES_BLOCKED.search(stub):
                stubs.setdefault(stub, None)
    return tuple(stubs)


@functools.cache
def _all_stdlib_functions() -> tuple[str, ...]:
    return _stubs_in(stdlib_files())


def stdlib_functions(limit: int | None = None) -> list[str]:
    """HumanEval-shaped stubs (signature and docstring, no body) of the running interpreter's
    stdlib functions: prompts of the evaluation's shape from code that is not the evaluation.
    The first `limit` of them, in file order, or all."""
    stubs = _all_stdlib_functions()
    return list(stubs if limit is None else stubs[:limit])


def package_version(package: str) -> str:
    """The installed version of the distribution that provides an importable package."""
    for dist in importlib.metadata.packages_distributions().get(package, [package]):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


@functools.cache
def package_functions(package: str, limit: int = PER_PACKAGE) -> tuple[str, ...]:
    """Stubs of an installed package's functions, chosen like the stdlib's (docstrings up to
    PACKAGE_MAX_DOCSTRING): at most `limit`, a seeded sample spread over the whole package, in
    file order. A package that is not installed is an error, not an empty source."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"no installed package named {package!r} (a package, not a single module)")
    stubs = [s for root in sorted(spec.submodule_search_locations)
             for s in _stubs_in(python_files(root), PACKAGE_MAX_DOCSTRING)]
    stubs = list(dict.fromkeys(stubs))
    if len(stubs) > limit:
        keep = set(random.Random(package).sample(range(len(stubs)), limit))
        stubs = [s for i, s in enumerate(stubs) if i in keep]
    return tuple(stubs)


SAMPLED_STUBS = 200
"""A corpus that needs at most this many stubs (and none from packages) takes them from a seeded
sample of the stdlib's files rather than from all of them: parsing the whole stdlib takes seconds
(ten on a busy two-core host), a large share of a short run on a CPU."""


def sampled_stdlib_functions(n: int, seed: int) -> list[str]:
    """At least n distinct stubs (all there are, if fewer), chosen like `stdlib_functions`, from
    the stdlib's files taken in an order shuffled by seed, in that order."""
    files = list(stdlib_files())
    random.Random(seed).shuffle(files)
    stubs: dict[str, None] = {}
    for path in files:
        if len(stubs) >= n:
            break
        stubs.update(dict.fromkeys(_stubs_in(iter([path]))))
    return list(stubs)


def all_stubs(packages: Sequence[str] = (), per_package: int = PER_PACKAGE) -> list[str]:
    """The stdlib's stubs, then each package's that are new, in the order given."""
    stubs = dict.fromkeys(stdlib_functions())
    for package in packages:
        stubs.update(dict.fromkeys(package_functions(package, per_package)))
    return list(stubs)


def corpus_mix(count: int, general_share: float = GENERAL_SHARE,
               programming_share: float = PROGRAMMING_SHARE, have_stubs: bool | None = None) -> dict[str, int]:
    """How many conversations of `count` come from each source."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not (0 <= general_share and 0 <= programming_share and general_share + programming_share <= 1):
        raise ValueError(f"shares must be >= 0 and sum to at most 1, got general {general_share} "
                         f"and programming {programming_share}")
    general = round(count * general_share)
    programming = round(count * programming_share)
    if not (bool(stdlib_functions()) if have_stubs is None else have_stubs):  # requests cover code
        return {"stubs": 0, "programming": count - general, "general": general}
    return {"stubs": count - general - programming, "programming": programming, "general": general}


def _requests(pool: Sequence[str], n: int, rng: random.Random) -> list[str]:
    """n requests from pool: each one once, as written, before any comes back; a request that
    comes back is wrapped in an opening and a closing not used for it before (while any are left),
    so every use is a different prompt."""
    combos = [(o, c) for o in OPENINGS for c in CLOSINGS if o or c]
    variations: dict[str, list[tuple[str, str]]] = {}
    out: list[str] = []
    use = 0
    while len(out) < n:
        order = list(pool)
        rng.shuffle(order)
        for text in order[: n - len(out)]:
            if use == 0:
                out.append(text)
                continue
            if text not in variations:
                variations[text] = rng.sample(combos, len(combos))
            opening, closing = variations[text][(use - 1) % len(combos)]
            joiner = "\n\n" if "\n" in text else " "
            out.append(opening + (text + joiner + closing if closing else text))
        use += 1
    return out


def _stub_prompts(stubs: Sequence[str], n: int, rng: random.Random) -> list[str]:
    """n stub prompts: every stub once before any comes back, and in a different phrasing each
    time. Each stub has the HumanEval phrasing on its first or its second appearance (alternating
    stub to stub), so about half the stub prompts use it while stubs appear at most twice."""
    order = list(stubs)
    rng.shuffle(order)
    phrasings = []
    for k in range(len(order)):
        others = rng.sample(range(1, len(STUB_TEMPLATES)), len(STUB_TEMPLATES) - 1)
        phrasings.append([0, *others] if k % 2 == 0 else [others[0], 0, *others[1:]])
    out = []
    for k in range(n):
        stub, turn = order[k % len(order)], k // len(order)
        template = STUB_TEMPLATES[phrasings[k % len(order)][turn % len(STUB_TEMPLATES)]]
        name = stub.split("def ", 1)[1].split("(", 1)[0]
        out.append(template.format(stub=stub, name=name))
    return out


def build_corpus(count: int, seed: int = 0, packages: Sequence[str] = (), *,
                 general_share: float = GENERAL_SHARE, programming_share: float = PROGRAMMING_SHARE,
                 per_package: int = PER_PACKAGE) -> list[Conversation]:
    """`count` one-turn user chats, shuffled, by default about 75% code and 25% general; the same
    for the same seed (interpreter and package versions). Stubs come from the stdlib and from
    `packages`, each used once before any comes back; a small corpus draws its stubs from a
    seeded sample of the stdlib's files (`SAMPLED_STUBS`)."""
    wanted = corpus_mix(count, general_share, programming_share, have_stubs=True)["stubs"]
    stubs = sampled_stdlib_functions(2 * wanted, seed) if not packages and wanted <= SAMPLED_STUBS \
        else all_stubs(packages, per_package)
    mix = corpus_mix(count, general_share, programming_share, have_stubs=bool(stubs))
    rng = random.Random(seed)
    prompts = (_stub_prompts(stubs, mix["stubs"], rng) if mix["stubs"] else []) + \
        _requests(PROGRAMMING_INSTRUCTIONS, mix["programming"], rng) + \
        _requests(GENERAL_INSTRUCTIONS, mix["general"], rng)
    rng.shuffle(prompts)
    return [[{"role": "user", "content": p}] for p in prompts]


def write_corpus(path: str | os.PathLike[str], conversations: Sequence[Conversation]) -> None:
    """JSON Lines, one {"messages": [...]} per line; gzip when the name ends in .gz (with mtime 0,
    so the same corpus is the same bytes)."""
    lines = (json.dumps({"messages": messages}, ensure_ascii=False) + "\n" for messages in conversations)
    if not str(path).endswith(".gz"):
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(lines)
        return
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz, \
            io.TextIOWrapper(gz, encoding="utf-8") as f:
        f.writelines(lines)


def read_corpus(path: str | os.PathLike[str]) -> list[Conversation]:
    """The conversations `write_corpus` wrote."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """Write a corpus to a file, for a training run to read back with `read_corpus`."""
    parser = argparse.ArgumentParser(prog="python -m speckernel.tools.train.corpus",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True, help="output file (.jsonl, or .jsonl.gz for gzip)")
    parser.add_argument("--count", type=int, required=True, help="number of conversations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--package", action="append", default=[], metavar="NAME",
                        help="also draw stubs from this installed package (repeatable)")
    parser.add_argument("--per-package", type=int, default=PER_PACKAGE, help="stubs from one package at most")
    parser.add_argument("--general-share", type=float, default=GENERAL_SHARE)
    parser.add_argument("--programming-share", type=float, default=PROGRAMMING_SHARE)
    args = parser.parse_args(argv)
    if args.count < 0:
        parser.error(f"--count must be >= 0, got {args.count}")
    try:
        conversations = build_corpus(args.count, args.seed, args.package, general_share=args.general_share,
                                     programming_share=args.programming_share, per_package=args.per_package)
        stubs = all_stubs(args.package, args.per_package)
        mix = corpus_mix(args.count, args.general_share, args.programming_share, have_stubs=bool(stubs))
    except ValueError as e:
        parser.error(str(e))
    write_corpus(args.out, conversations)
    sources = [f"{len(stdlib_functions())} from the stdlib of Python {sys.version_info.major}.{sys.version_info.minor}"]
    sources += [f"{len(package_functions(p, args.per_package))} from {p} {package_version(p)}" for p in args.package]
    print(f"train_corpus: wrote {len(conversations)} conversations to {args.out} (seed {args.seed}): "
          f"{mix['stubs']} function stub prompts (from {len(stubs)} "
          f"distinct stubs: {', '.join(sources)}), {mix['programming']} programming and "
          f"{mix['general']} general hand-written requests (from {len(PROGRAMMING_INSTRUCTIONS)} and "
          f"{len(GENERAL_INSTRUCTIONS)} distinct)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
