"""A small English corpus, written for this project, for training the tiny checkpoint's BPE tokenizer."""

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still say hello to the world.
Once upon a time there was a little robot who lived in a quiet town by the sea. Every morning the
robot walked to the harbour, counted the boats, and wrote the numbers in a blue notebook.
One day a storm came from the west. The wind was strong and the waves were high, and the boats
did not come back at the usual time. The robot waited on the pier and watched the water.
When the sun came out again, the first boat appeared, then the second, then all of them.
The people of the town thanked the robot, and the robot wrote a new number in its notebook.

How does a language model work? It reads a sequence of tokens and predicts the next one.
Each token is a piece of text: a word, part of a word, a number, or a single character.
The model turns tokens into vectors, mixes them with attention, and returns a score for every
token in its vocabulary. The highest score wins when decoding greedily; sampling picks at random
in proportion to the scores after a softmax with a temperature.

Serving a model to many users at once is a problem of scheduling. Requests arrive at different
times and ask for different lengths. A good server batches them together, keeps the accelerator
busy, and stores the keys and values of past tokens in a cache so that they are not computed twice.
The cache is split into blocks of a fixed size, like pages of memory in an operating system.
A table maps each request to its blocks, and free blocks return to a pool when a request ends.

Prefill processes the prompt in one large step; decode produces one token per step for each request.
Prefill is limited by compute and decode is limited by memory bandwidth, so running them on
separate machines lets each pool be sized for its own work. The prefill worker sends the cache
blocks to the decode worker, which continues the answer without recomputing the prompt.

Numbers and symbols matter too: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14 + - * / = < > ( ) [ ] { }
Questions end with a question mark? Exclamations end with a mark! Lists use commas, semicolons;
and colons: like this. "Quotes" and 'single quotes' appear in code and in dialogue.

def add(a, b):
    return a + b

for item in items:
    if item is not None:
        print(item)

User: What is the capital of France?
Assistant: The capital of France is Paris.
User: Can you write a short poem about the sea?
Assistant: The sea is wide, the sea is deep, it sings the harbour town to sleep.
User: Thank you, that is lovely.
Assistant: You are welcome. Is there anything else I can help you with today?

Spring brings rain and green leaves; summer brings long days and warm nights. In autumn the trees
turn red and gold, and in winter the lakes freeze and the children skate on the ice.
Good morning, good afternoon, good evening, and good night. Please and thank you. Yes and no.
Café, naïve, über, piñata, smörgåsbord: some words carry accents. 日本語 and 中文 and 한국어 are
written with other scripts, and emoji such as 🙂 and 🚀 take four bytes each in UTF-8.
"""
