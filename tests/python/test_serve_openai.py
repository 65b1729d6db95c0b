"""`prompt-r1 serve` driven by the official `openai` Python client.

Usage: test_serve_openai.py BASE_URL MODEL  (e.g. http://127.0.0.1:8000/v1 tiny)
Exits non-zero on the first failed check.
"""

import sys

import openai
from openai import OpenAI


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def main(base_url, model):
    client = OpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=120)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]

    models = client.models.list()
    ids = [m.id for m in models.data]
    check(model in ids, f"{model} not in /v1/models: {ids}")

    # Non-streaming.
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0.8, seed=7
    )
    check(reply.object == "chat.completion", reply)
    check(reply.model == model, reply)
    check(len(reply.choices) == 1, reply)
    choice = reply.choices[0]
    check(choice.message.role == "assistant", choice)
    check(isinstance(choice.message.content, str), choice)
    check(choice.finish_reason in ("stop", "length"), choice)
    usage = reply.usage
    check(usage.prompt_tokens > 0, usage)
    check(0 < usage.completion_tokens <= 16, usage)
    check(usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage)
    again = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0.8, seed=7
    )
    check(again.choices[0].message.content == choice.message.content, "same seed, other text")

    # Streaming: the same text, finish reason and usage as the plain request.
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=16,
        temperature=0.8,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, stream_usage, chunks = [], None, None, 0
    for chunk in stream:
        chunks += 1
        check(chunk.object == "chat.completion.chunk", chunk)
        if chunk.choices:
            delta = chunk.choices[0].delta
            if delta.content:
                pieces.append(delta.content)
            if chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        if chunk.usage:
            stream_usage = chunk.usage
    check(chunks >= 3, f"only {chunks} chunks")
    check("".join(pieces) == choice.message.content, (pieces, choice.message.content))
    check(finish == choice.finish_reason, (finish, choice.finish_reason))
    check(stream_usage is not None and stream_usage.completion_tokens == usage.completion_tokens,
          stream_usage)

    # max_completion_tokens (the newer name of max_tokens).
    text = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=3, temperature=0
    )
    check(text.usage.completion_tokens <= 3, text.usage)

    # Text completions take the raw ChatML prompt (how infer/eval ask a served agent).
    raw = client.completions.create(
        model=model,
        prompt="<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        max_tokens=5,
        temperature=0,
    )
    check(raw.object == "text_completion", raw)
    check(isinstance(raw.choices[0].text, str), raw)
    check(raw.usage.completion_tokens <= 5, raw.usage)

    # Errors come back as the client's exception types.
    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        check(False, "an unknown model was accepted")
    except openai.NotFoundError as err:
        check(err.status_code == 404, err)
    try:
        client.chat.completions.create(model=model, messages=messages, n=2)
        check(False, "n=2 was accepted")
    except openai.BadRequestError as err:
        check(err.status_code == 400, err)
        check("n" == (err.body or {}).get("param"), err.body)

    print(f"ok: openai {openai.__version__} against {base_url}: models, chat, streaming, completions, errors")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: test_serve_openai.py BASE_URL MODEL")
    main(sys.argv[1], sys.argv[2])
