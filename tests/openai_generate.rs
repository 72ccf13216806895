//! The OpenAI API against the real SmolLM2 model: whole and streamed chat
//! and text completions, greedy determinism, max_tokens, stop strings,
//! context overflow, client disconnects, and several models side by side.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::{Value, json};
use support::{Server, real_model};

fn server() -> (Server, String) {
    support::model_server("")
}

fn post_with(s: &Server, path: &str, body: &Value, headers: &[(&str, &str)]) -> support::Response {
    let bytes = serde_json::to_vec(body).expect("encode");
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    s.request("POST", path, &h, Some(&bytes))
}

/// POSTs and asserts 200, returning the JSON body.
#[track_caller]
fn ok(s: &Server, path: &str, body: &Value) -> Value {
    let r = s.post_json(path, body);
    assert_eq!(r.status, 200, "{}; log:\n{}", r.text(), s.log_text());
    r.json()
}

/// Splits an SSE body into its `data:` payloads; asserts the framing.
fn sse_data(r: &support::Response) -> Vec<String> {
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert_eq!(r.header("cache-control"), Some("no-cache"));
    let text = r.text();
    assert!(text.ends_with("\n\n"), "{text:?}");
    text.trim_end()
        .split("\n\n")
        .map(|event| {
            let data = event
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .unwrap_or_else(|| panic!("event without data: {event:?}"));
            assert!(
                !event.lines().any(|l| l.starts_with("event: error")),
                "error event: {event}"
            );
            data.to_owned()
        })
        .collect()
}

fn chat(model: &str, content: &str, extra: Value) -> Value {
    let mut v = json!({"model": model, "messages": [{"role": "user", "content": content}]});
    if let (Value::Object(base), Value::Object(extra)) = (&mut v, extra) {
        base.extend(extra);
    }
    v
}

#[test]
fn chat_completion_whole() {
    let (s, model) = server();
    let r = post_with(
        &s,
        "/v1/chat/completions",
        &chat(
            &model,
            "What is the capital of France?",
            json!({"max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 2}),
        ),
        &[("x-request-id", "req-42")],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["id"], "chatcmpl-req-42");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], model.as_str());
    assert!(v["created"].as_u64().is_some_and(|c| c > 0), "{v}");
    assert!(v["system_fingerprint"].is_string(), "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    let text = choice["message"]["content"].as_str().expect("content");
    assert!(!text.is_empty(), "{v}");
    assert!(
        ["stop", "length"].contains(&choice["finish_reason"].as_str().unwrap_or("")),
        "{v}"
    );
    let usage = &v["usage"];
    let (p, c) = (
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["completion_tokens"].as_u64().unwrap(),
    );
    assert!(p > 5 && (1..=8).contains(&c), "{usage}");
    assert_eq!(usage["total_tokens"].as_u64(), Some(p + c));

    let lp = choice["logprobs"]["content"].as_array().expect("logprobs");
    assert_eq!(lp.len() as u64, c, "one logprob entry per token");
    let joined: String = lp.iter().filter_map(|t| t["token"].as_str()).collect();
    // The end-of-sequence token is neither content nor a logprob entry.
    assert!(
        joined.starts_with(text),
        "tokens spell the content: {joined:?}"
    );
    for t in lp {
        assert!(t["logprob"].as_f64().is_some_and(|l| l <= 0.0), "{t}");
        assert!(t["bytes"].is_array(), "{t}");
        assert_eq!(t["top_logprobs"].as_array().map(Vec::len), Some(2), "{t}");
    }
}

/// A `Server-Timing` header's entries, `name;dur=MS`, in order.
fn server_timing(r: &support::Response) -> Vec<(String, f64)> {
    let value = r
        .header("server-timing")
        .unwrap_or_else(|| panic!("no server-timing header: {:?}", r.headers));
    value
        .split(", ")
        .map(|entry| {
            let (name, dur) = entry
                .split_once(";dur=")
                .unwrap_or_else(|| panic!("{value}"));
            (
                name.to_owned(),
                dur.parse().unwrap_or_else(|e| panic!("{e}: {value}")),
            )
        })
        .collect()
}

#[test]
fn whole_answers_say_where_their_time_went() {
    let (s, model) = server();
    let prompt = "Write a short poem about the sea.";
    let anthropic = [("anthropic-version", "2023-06-01")];
    let asked = [
        (
            "/v1/chat/completions",
            chat(&model, prompt, json!({"max_tokens": 8, "temperature": 0})),
            &[][..],
        ),
        (
            "/v1/completions",
            // (A raw prompt; this chat one's greedy answer is empty.)
            json!({"model": model, "prompt": "The sea is", "max_tokens": 8, "temperature": 0}),
            &[][..],
        ),
        (
            "/v1/messages",
            json!({"model": model, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}),
            &anthropic[..],
        ),
        (
            "/v1/responses",
            json!({"model": model, "input": prompt, "max_output_tokens": 8, "temperature": 0}),
            &[][..],
        ),
    ];
    for (path, body, headers) in asked {
        let r = post_with(&s, path, &body, headers);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        let timing = server_timing(&r);
        let names: Vec<&str> = timing.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            ["prepare", "queue", "prefill", "decode", "total"],
            "{path}"
        );
        let dur = |name: &str| timing.iter().find(|(n, _)| n == name).unwrap().1;
        assert!(timing.iter().all(|(_, d)| *d >= 0.0), "{path}: {timing:?}");
        // The prompt went through the model, and (greedy) eight tokens came out.
        assert!(
            dur("prefill") > 0.0 && dur("decode") > 0.0,
            "{path}: {timing:?}"
        );
        // The phases follow each other within the whole (printed to 0.01 ms).
        let phases: f64 = ["prepare", "queue", "prefill", "decode"]
            .iter()
            .map(|n| dur(n))
            .sum();
        assert!(phases <= dur("total") + 0.05, "{path}: {timing:?}");
    }
    // An answer whose first pick ends it (greedy, this raw prompt) still
    // prefilled, up to its end, and decoded nothing.
    let empty = json!({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0});
    let r = post_with(&s, "/v1/completions", &empty, &[]);
    assert_eq!(r.json()["usage"]["completion_tokens"], 0, "{}", r.text());
    let timing = server_timing(&r);
    assert!(timing[2].0 == "prefill" && timing[2].1 > 0.0, "{timing:?}");
    assert_eq!(timing[3], ("decode".to_owned(), 0.0), "{timing:?}");
    // A streamed answer's headers leave before its first token.
    let streamed = chat(&model, prompt, json!({"max_tokens": 4, "stream": true}));
    let r = s.post_json("/v1/chat/completions", &streamed);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("server-timing"), None);
}

#[test]
fn chat_completion_streamed() {
    let (s, model) = server();
    let body = chat(
        &model,
        "Say hello.",
        json!({"max_tokens": 6, "stream": true, "stream_options": {"include_usage": true}}),
    );
    let data = sse_data(&s.post_json("/v1/chat/completions", &body));
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect();
    assert!(chunks.len() >= 3, "{chunks:?}");
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], model.as_str());
        assert!(c["id"].as_str().unwrap_or("").starts_with("chatcmpl-"));
        assert_eq!(c["id"], chunks[0]["id"]);
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage_chunk = &chunks[chunks.len() - 1];
    assert_eq!(usage_chunk["choices"], json!([]));
    let completion_tokens = usage_chunk["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=6).contains(&completion_tokens), "{usage_chunk}");
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["delta"], json!({}));
    assert!(
        finish["choices"][0]["finish_reason"].is_string(),
        "{finish}"
    );
    let text: String = chunks[1..chunks.len() - 2]
        .iter()
        .map(|c| {
            assert!(c["choices"][0]["finish_reason"].is_null(), "{c}");
            assert!(c["usage"].is_null(), "{c}");
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        })
        .collect();
    assert!(!text.is_empty());

    // Without include_usage: no usage chunk, and no usage key at all.
    let body = chat(
        &model,
        "Say hello.",
        json!({"max_tokens": 3, "stream": true}),
    );
    let data = sse_data(&s.post_json("/v1/chat/completions", &body));
    let last: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert!(last["choices"][0]["finish_reason"].is_string(), "{last}");
    assert!(last.get("usage").is_none(), "{last}");
}

#[test]
fn text_completion_whole_and_streamed() {
    let (s, model) = server();
    let v = ok(
        &s,
        "/v1/completions",
        &json!({"model": model, "prompt": "The sky is", "max_tokens": 5, "temperature": 0, "logprobs": 2}),
    );
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap_or("").starts_with("cmpl-"), "{v}");
    let choice = &v["choices"][0];
    let text = choice["text"].as_str().expect("text");
    let lp = &choice["logprobs"];
    let tokens = lp["tokens"].as_array().expect("tokens");
    assert_eq!(tokens.len(), lp["token_logprobs"].as_array().unwrap().len());
    assert_eq!(tokens.len(), lp["text_offset"].as_array().unwrap().len());
    assert_eq!(tokens.len(), lp["top_logprobs"].as_array().unwrap().len());
    let joined: String = tokens.iter().filter_map(Value::as_str).collect();
    assert!(joined.starts_with(text), "{joined:?} vs {text:?}");
    assert_eq!(
        v["usage"]["completion_tokens"].as_u64(),
        Some(tokens.len() as u64)
    );

    // Token-id prompts work too.
    let v = ok(
        &s,
        "/v1/completions",
        &json!({"model": model, "prompt": [504, 3456, 314], "max_tokens": 2}),
    );
    assert_eq!(v["usage"]["prompt_tokens"], 3, "{v}");

    let r = s.post_json(
        "/v1/completions",
        &json!({"model": model, "prompt": "The sky is", "max_tokens": 5, "temperature": 0, "stream": true}),
    );
    let data = sse_data(&r);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let streamed: String = data[..data.len() - 1]
        .iter()
        .map(|d| {
            let c: Value = serde_json::from_str(d).unwrap();
            assert_eq!(c["object"], "text_completion");
            c["choices"][0]["text"].as_str().unwrap_or("").to_owned()
        })
        .collect();
    assert_eq!(streamed, text, "streamed greedy text equals the whole one");
}

#[test]
fn greedy_is_deterministic_and_max_tokens_ends_with_length() {
    let (s, model) = server();
    let body = chat(
        &model,
        "Write a sentence about cats.",
        json!({"max_tokens": 3, "temperature": 0}),
    );
    let a = ok(&s, "/v1/chat/completions", &body);
    let b = ok(&s, "/v1/chat/completions", &body);
    assert_eq!(
        a["choices"][0]["message"]["content"],
        b["choices"][0]["message"]["content"]
    );
    assert_eq!(a["choices"][0]["finish_reason"], "length", "{a}");
    assert_eq!(a["usage"]["completion_tokens"], 3, "{a}");
    // max_completion_tokens is the newer spelling of the same limit.
    let c = ok(
        &s,
        "/v1/chat/completions",
        &chat(
            &model,
            "Write a sentence about cats.",
            json!({"max_completion_tokens": 3, "temperature": 0}),
        ),
    );
    assert_eq!(c["usage"]["completion_tokens"], 3, "{c}");
    assert_eq!(
        c["choices"][0]["message"]["content"],
        a["choices"][0]["message"]["content"]
    );
}

#[test]
fn stop_string_ends_generation_and_is_not_emitted() {
    let (s, model) = server();
    let prompt = "List the numbers from one to ten in words, separated by commas.";
    let free = ok(
        &s,
        "/v1/chat/completions",
        &chat(&model, prompt, json!({"max_tokens": 24, "temperature": 0})),
    );
    let text = free["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    // A stop string from the middle of the greedy output.
    let chars: Vec<char> = text.chars().collect();
    assert!(
        chars.len() >= 8,
        "too short to pick a stop string: {text:?}"
    );
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let stop = stop.as_str();
    let cut = text.find(stop).unwrap();
    let stopped = ok(
        &s,
        "/v1/chat/completions",
        &chat(
            &model,
            prompt,
            json!({"max_tokens": 24, "temperature": 0, "stop": [stop]}),
        ),
    );
    let got = stopped["choices"][0]["message"]["content"]
        .as_str()
        .unwrap();
    assert_eq!(got, &text[..cut], "stop {stop:?} in {text:?}");
    assert!(!got.contains(stop));
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
}

#[test]
fn prompt_longer_than_the_context_is_400_context_length_exceeded() {
    let (s, model) = server();
    let long = "hello ".repeat(10_000);
    let e = s
        .post_json("/v1/chat/completions", &chat(&model, &long, json!({})))
        .api_error(400, "invalid_request_error", "context_length_exceeded");
    assert_eq!(e["param"], "messages");
    assert!(
        e["message"]
            .as_str()
            .unwrap_or("")
            .contains("maximum context length"),
        "{e}"
    );
    let e = s
        .post_json(
            "/v1/completions",
            &json!({"model": model, "prompt": "hi", "max_tokens": 10_000_000}),
        )
        .api_error(400, "invalid_request_error", "context_length_exceeded");
    assert_eq!(e["param"], "prompt");
    // Token ids outside the vocabulary are the client's mistake too.
    let e = s
        .post_json(
            "/v1/chat/completions",
            &chat(&model, "hi", json!({"logit_bias": {"999999999": 5}})),
        )
        .api_error(400, "invalid_request_error", "invalid_value");
    assert_eq!(e["param"], "logit_bias");
}

#[test]
fn a_client_hanging_up_mid_stream_does_not_break_the_next_request() {
    let (s, model) = server();
    for _ in 0..2 {
        let body = serde_json::to_vec(&chat(
            &model,
            "Tell me a long story about a dragon.",
            json!({"max_tokens": 400, "stream": true}),
        ))
        .unwrap();
        let mut stream = TcpStream::connect(s.addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        write!(
            stream,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .unwrap();
        stream.write_all(&body).unwrap();
        // Read until the first content chunk has arrived, then hang up.
        let mut reader = BufReader::new(stream);
        let mut seen = 0;
        let mut line = String::new();
        while seen < 3 {
            line.clear();
            let n = reader.read_line(&mut line).expect("read stream");
            assert!(n > 0, "stream ended early");
            if line.starts_with("data: ") {
                seen += 1;
            }
        }
        drop(reader);
    }
    let v = ok(
        &s,
        "/v1/chat/completions",
        &chat(&model, "Say hi.", json!({"max_tokens": 3})),
    );
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    assert!(!s.log_text().contains("panic"), "log:\n{}", s.log_text());
}

/// CPU time (user + system, in clock ticks) the process has used so far.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc stat");
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields of the whole line.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// Starts a generation that would run for minutes (end-of-sequence banned),
/// hangs up once it is under way, and returns how long the server took to go
/// idle afterwards; panics if it stays busy.
fn seconds_until_idle_after_hanging_up(stream: bool) -> u64 {
    let (s, model) = server();
    // SmolLM2's end-of-sequence ids: <|endoftext|> 0, <|im_end|> 2.
    let body = serde_json::to_vec(&chat(
        &model,
        "Tell me a long story about a dragon.",
        json!({"max_tokens": 4000, "stream": stream, "logit_bias": {"0": -100, "2": -100}}),
    ))
    .unwrap();
    let mut conn = TcpStream::connect(s.addr).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    write!(
        conn,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    conn.write_all(&body).unwrap();
    let busy = |pid| {
        let t = cpu_ticks(pid);
        std::thread::sleep(Duration::from_secs(1));
        cpu_ticks(pid) - t
    };
    if stream {
        // Under way once content arrives.
        let mut reader = BufReader::new(conn.try_clone().unwrap());
        let mut line = String::new();
        while !line.contains("\"content\":\"") || line.contains("\"content\":\"\"") {
            line.clear();
            assert!(
                reader.read_line(&mut line).expect("read") > 0,
                "stream ended"
            );
        }
    }
    assert!(busy(s.pid()) > 20, "the server is not generating");
    drop(conn);
    for waited in 1..=45 {
        // A clock tick is 10 ms: at most a tenth of a core counts as idle.
        if busy(s.pid()) <= 10 {
            return waited;
        }
    }
    panic!("stream={stream}: the server is still busy 45 s after its only client hung up");
}

#[test]
fn a_client_hanging_up_cancels_its_generation() {
    for stream in [true, false] {
        let waited = seconds_until_idle_after_hanging_up(stream);
        eprintln!("stream={stream}: idle {waited} s after the hang-up");
    }
}

#[test]
fn stream_chunks_arrive_as_they_are_generated() {
    let (s, model) = server();
    let body = serde_json::to_vec(&chat(
        &model,
        "Tell me a story about a lighthouse keeper.",
        json!({"max_tokens": 48, "temperature": 0, "stream": true}),
    ))
    .unwrap();
    let mut stream = TcpStream::connect(s.addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let started = std::time::Instant::now();
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    stream.write_all(&body).unwrap();
    // Arrival time of each content chunk, and of [DONE].
    let mut reader = BufReader::new(stream);
    let mut content_at = Vec::new();
    let mut line = String::new();
    let done_at = loop {
        line.clear();
        let n = reader.read_line(&mut line).expect("read stream");
        assert!(n > 0, "stream ended before [DONE]");
        let Some(data) = line.trim_end().strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break started.elapsed();
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        if chunk["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|c| !c.is_empty())
        {
            content_at.push(started.elapsed());
        }
    };
    assert!(!content_at.is_empty());
    // Unbuffered: the first token shows up long before the last one is
    // generated (decoding dominates a 48-token answer).
    if content_at.len() >= 16 {
        assert!(
            content_at[0] < done_at / 2,
            "first content after {:?}, [DONE] after {done_at:?}: the stream looks buffered",
            content_at[0]
        );
    }
}

#[test]
fn two_models_are_served_side_by_side() {
    let path = real_model();
    let config = format!(
        "[[models]]\npath = \"{}\"\nid = \"smol-b\"\n",
        path.display()
    );
    let (s, first) = support::model_server(&config);
    let list = s.get("/v1/models").json();
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, [first.as_str(), "smol-b"]);
    assert_eq!(s.get("/v1/models/smol-b").json()["owned_by"], "mlxgate");
    for model in [first.as_str(), "smol-b"] {
        let v = ok(
            &s,
            "/v1/chat/completions",
            &chat(model, "Hi", json!({"max_tokens": 2, "temperature": 0})),
        );
        assert_eq!(v["model"], model);
    }
    let ready = s.get("/readyz").json();
    assert_eq!(ready["models"], json!([first, "smol-b"]));
}

#[test]
fn n_choices_share_one_prefill_and_each_matches_a_lone_request() {
    let (s, model) = server();
    let ask = |extra: Value| chat(&model, "Name a colour.", extra);
    // Greedy: every choice is the one answer a single request gets.
    let lone = ok(
        &s,
        "/v1/chat/completions",
        &ask(json!({"max_tokens": 8, "temperature": 0})),
    );
    let three = ok(
        &s,
        "/v1/chat/completions",
        &ask(json!({"max_tokens": 8, "temperature": 0, "n": 3})),
    );
    let choices = three["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{three}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{three}");
        assert_eq!(c["message"], lone["choices"][0]["message"], "{three}");
    }
    let (one, all) = (&lone["usage"], &three["usage"]);
    assert_eq!(
        all["prompt_tokens"], one["prompt_tokens"],
        "the prompt counts once"
    );
    assert_eq!(
        all["completion_tokens"].as_u64(),
        one["completion_tokens"].as_u64().map(|c| 3 * c)
    );

    // Sampled and seeded: choice i is a lone request seeded seed + i.
    let sampled = |n: u64, seed: u64| {
        ok(
            &s,
            "/v1/completions",
            &json!({"model": model, "prompt": "Once upon a time", "max_tokens": 10,
                    "temperature": 1.0, "seed": seed, "n": n}),
        )
    };
    let pair = sampled(2, 7);
    for (i, seed) in [(0, 7), (1, 8)] {
        assert_eq!(
            pair["choices"][i]["text"],
            sampled(1, seed)["choices"][0]["text"],
            "{pair}"
        );
    }

    // Streamed: chunks carry their choice's index; one [DONE] after both.
    let body = ask(json!({"max_tokens": 8, "temperature": 0, "n": 2, "stream": true}));
    let data = sse_data(&s.post_json("/v1/chat/completions", &body));
    assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1);
    let mut texts = [String::new(), String::new()];
    let mut finished = [false, false];
    for d in &data[..data.len() - 1] {
        let chunk: Value = serde_json::from_str(d).unwrap();
        let c = &chunk["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        texts[i] += c["delta"]["content"].as_str().unwrap_or("");
        finished[i] |= c["finish_reason"].is_string();
    }
    assert_eq!(finished, [true, true]);
    let want = lone["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(texts, [want, want]);
}
