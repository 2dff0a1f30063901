"""conversation_key: the vectors of DESIGN §1 and each request format."""

import pytest

from autosessd.base.keys import chat_signature, continues, conversation_key, messages_key


@pytest.mark.parametrize(
    "body, key",
    [
        ({"messages": [{"role": "user", "content": "Hello"}]}, "f7ff9e8b7bb2e09b"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                                     {"type": "text", "text": "part two"}]}]}, "9d9b666e26eb657d"),
        ({"messages": [{"role": "user", "content": "héllo wörld"}]}, "24e9f5c07847ff8a"),
        # system and assistant messages before the first user message do not count
        ({"messages": [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "hi"},
                       {"role": "user", "content": "Hello"}, {"role": "user", "content": "later"}]},
         "f7ff9e8b7bb2e09b"),
        # Anthropic: system is a top-level field, not a message
        ({"system": "x", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]},
         "f7ff9e8b7bb2e09b"),
        # image parts carry no text
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                     {"type": "text", "text": "Hello"}]}]}, "f7ff9e8b7bb2e09b"),
        # OpenAI responses: a string input, and input items with input_text parts
        ({"input": "Hello"}, "f7ff9e8b7bb2e09b"),
        ({"input": [{"role": "developer", "content": "rules"},
                    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}]},
         "f7ff9e8b7bb2e09b"),
    ],
)
def test_key_of_conversation_requests(body, key):
    assert conversation_key(body) == key


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "Hello"},  # raw completion
        {"content": "Hello"},  # tokenize
        {"input": ["Hello", "world"]},  # embeddings take a list of strings
        {"messages": [{"role": "system", "content": "only a system prompt"}]},
        {"messages": [{"role": "user", "content": ""}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": "not a list"},
        {"messages": [None, 3, "x", {"role": "user", "content": 5}]},
        [],
        None,
        "Hello",
    ],
)
def test_no_user_text_means_no_key(body):
    assert conversation_key(body) is None


def test_lone_surrogate_does_not_raise():
    assert len(conversation_key({"messages": [{"role": "user", "content": "\ud800"}]})) == 16


def test_messages_key_matches_request_key():
    msgs = [{"role": "user", "content": "Hello"}]
    assert messages_key(msgs) == conversation_key({"messages": msgs}) == "f7ff9e8b7bb2e09b"
    assert messages_key("nope") is None


def test_chat_signature_goes_on_only_with_the_same_options_and_earlier_messages_first():
    a = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "stream": True}
    grown = {**a, "messages": a["messages"] + [{"role": "assistant", "content": "Yo"}, {"role": "user", "content": "?"}],
             "temperature": 0.7, "max_tokens": 5, "seed": 3}
    assert continues(chat_signature(a), chat_signature(grown))  # sampling fields do not shape the prompt
    assert continues(chat_signature(a), chat_signature(a))
    assert not continues(chat_signature(grown), chat_signature(a))
    assert not continues(chat_signature(a), chat_signature({**grown, "tools": [{"type": "function"}]}))
    assert not continues(chat_signature(a), chat_signature({**grown, "chat_template_kwargs": {"x": 1}}))
    edited = {**grown, "messages": [{"role": "user", "content": "Hi!"}] + grown["messages"][1:]}
    assert not continues(chat_signature(a), chat_signature(edited))
    assert not continues(None, chat_signature(a))


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
    {"messages": []}, {"messages": "x"}, {"messages": [3]}, None, [], {"input": "Hello"},
])
def test_chat_signature_is_none_for_media_and_bodies_that_are_not_openai_chat(body):
    assert chat_signature(body) is None


def test_a_message_sent_again_gets_the_same_digest_from_the_cache_as_computed_afresh():
    """Issue 23: the earlier messages of a conversation come again with every request; their
    digests are remembered (the signature of a 20k-token body cost ~0.4 ms a turn), and what
    is remembered is exactly what would be computed."""
    from autosessd.base import keys

    def body():
        return {"messages": [{"role": "user", "content": "x " * 42000}, {"role": "assistant", "content": "ok"},
                             {"role": "user", "content": [{"type": "text", "text": "parts"}]}]}

    first = keys.chat_signature(body())
    again = keys.chat_signature(body())
    keys._SEEN.clear()
    assert first == again == keys.chat_signature(body())
    assert first[1:] == tuple(keys._digest(m) for m in body()["messages"])
    edited = body()
    edited["messages"][0]["content"] += "!"
    assert keys.chat_signature(edited)[1] != first[1]


@pytest.mark.parametrize("n", [5, 3000])  # a text that is its own lookup key, and one keyed by its hash
def test_messages_that_differ_only_in_where_their_text_lies_never_share_a_digest(n):
    """The cache's keys (keys._seen_key) tell apart what a careless key would merge: text moved
    from one field to the other, the same values under other fields, another field added."""
    from autosessd.base import keys

    t = "y" * n
    lookalikes = [{"role": "user", "content": t + "z"}, {"role": "user" + t[:1], "content": t[1:] + "z"},
                  {"role": t + "z", "content": "user"}, {"content": "user", "name": t + "z"},
                  {"role": "user", "content": t + "z", "name": ""}, {"role": "user", "content": t + "z "}]
    for _ in range(2):  # computed, then remembered
        got = [keys._message_digest(m) for m in lookalikes]
        assert got == [keys._digest(m) for m in lookalikes]
        assert len(set(got)) == len(lookalikes)
