"""An LLM judge as a reward: `api_reward` (registered by the scripts under the name `api`) asks an OpenAI-compatible
/chat/completions endpoint (vLLM, SGLang, OpenAI) to score each completion; `ApiJudge` is the same with settings of
your own. Standard library only."""

import concurrent.futures
import functools
import json
import os
import re
import time
import urllib.error
import urllib.request

from common.rewards import text_of

JUDGE_TEMPLATE = (
    "Rate the response to the question from 0 to 10. Reply with 'Score: N'.\n\nQuestion:\n{prompt}\n\n"
    "Reference answer (may be empty):\n{answer}\n\nResponse:\n{completion}"
)


class ApiJudge:
    """An LLM judge behind an OpenAI-compatible /chat/completions endpoint (vLLM, SGLang, OpenAI), stdlib only.

    Each completion goes out as one user message (the template's {prompt} {completion} {answer} filled in); the
    first number of the reply ("Score: 7/10" -> 7) / max_score, clipped to [0, 1], is its reward (None without a
    number). 429, 5xx, timeouts and connection errors are retried with exponential backoff, then a RuntimeError
    names the URL: an unreachable judge stops training rather than silently rewarding 0."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        template: str = JUDGE_TEMPLATE,
        max_score: float = 10.0,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 1.0,
        max_workers: int = 8,
    ):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.template = template
        self.max_score = max_score
        self.api_key = os.environ.get("OPENAI_API_KEY") if api_key is None else api_key
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_workers = max_workers

    def _post(self, content: str) -> str:
        """The reply text of one chat completion, retrying what may pass (429, 5xx, network)."""
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": content}], "temperature": 0})
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        headers = {"Content-Type": "application/json", **auth}
        for attempt in range(self.retries + 1):
            try:
                request = urllib.request.Request(self.url, data=body.encode(), headers=headers)
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())["choices"][0]["message"]["content"]
            except urllib.error.HTTPError as e:  # before URLError, its base class
                if e.code != 429 and e.code < 500:  # a bad request or key will not fix itself
                    raise RuntimeError(f"judge {self.url} answered HTTP {e.code}: {e.read()[:500]!r}") from e
                error = e
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                error = e
            if attempt < self.retries:
                time.sleep(self.backoff * 2**attempt)
        raise RuntimeError(f"judge {self.url} unreachable after {self.retries + 1} attempts: {error}")

    def score(self, prompt, completion, answer=None) -> float | None:
        """One reward in [0, 1], None if the reply has no number."""
        content = self.template.replace("{prompt}", text_of(prompt, last_assistant=False))
        content = content.replace("{answer}", "" if answer is None else str(answer))
        reply = self._post(content.replace("{completion}", text_of(completion)))  # last: its text is not re-scanned
        m = re.search(r"-?\d+(?:\.\d+)?", reply)
        return None if m is None else min(max(float(m.group()) / self.max_score, 0.0), 1.0)

    def __call__(self, prompts, completions, answer=None, **kw) -> list[float | None]:
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            return list(pool.map(self.score, prompts, completions, answer or [None] * len(completions)))


@functools.cache  # built on first use, not at import: the env vars only matter when "api" is asked for
def _env_judge() -> ApiJudge:
    url = os.environ.get("ONLYONE_JUDGE_URL")
    model = os.environ.get("ONLYONE_JUDGE_MODEL")
    if not url or not model:
        raise RuntimeError(
            "reward 'api' needs ONLYONE_JUDGE_URL (e.g. http://localhost:8000/v1) and "
            "ONLYONE_JUDGE_MODEL (OPENAI_API_KEY if the endpoint wants one)"
        )
    return ApiJudge(url, model)


def api_reward(prompts, completions, **kw) -> list[float | None]:
    """An ApiJudge with default settings at ONLYONE_JUDGE_URL / ONLYONE_JUDGE_MODEL (key: OPENAI_API_KEY)."""
    return _env_judge()(prompts, completions, **kw)
