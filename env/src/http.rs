//! Small HTTP helpers shared by the clients of OpenAI-compatible servers (this crate's
//! [`OpenAiClient`](crate::OpenAiClient) and the trainer's rollout workers): reading an error
//! reply, shortening text for error messages, and telling a local server from a remote one.
//! The API key they send is [`ApiKey`](crate::ApiKey).

use serde_json::Value;

/// The most characters of a server's text that [`excerpt`] keeps.
pub const EXCERPT_CHARS: usize = 300;

/// The server's explanation in an error reply's body, shortened by [`excerpt`]: the first of
/// OpenAI's `{"error": {"message"}}`, vLLM's `{"message"}`, FastAPI's `{"detail"}` and a bare
/// `{"error"}` that is present and not null (a value that is not a string in its JSON form),
/// else an excerpt of the body itself.
pub fn error_message(body: &str) -> String {
    if let Ok(value) = serde_json::from_str::<Value>(body) {
        let found = [
            value.pointer("/error/message"),
            value.get("message"),
            value.get("detail"),
            value.get("error"),
        ]
        .into_iter()
        .flatten()
        .find(|found| !found.is_null());
        match found {
            Some(Value::String(text)) => return excerpt(text),
            Some(other) => return excerpt(&other.to_string()),
            None => {}
        }
    }
    excerpt(body)
}

/// `text` trimmed, cut after [`EXCERPT_CHARS`] characters (with `…` where it was cut), for
/// error messages.
pub fn excerpt(text: &str) -> String {
    let text = text.trim();
    match text.char_indices().nth(EXCERPT_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

/// Whether the URL's host is this machine (`localhost` or a loopback address), whose requests
/// should bypass the proxies named in the environment.
pub fn is_loopback(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host_port = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let host = if let Some(v6) = host_port.strip_prefix('[') {
        v6.split(']').next().unwrap_or("")
    } else {
        host_port.split(':').next().unwrap_or("")
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts() {
        assert!(is_loopback("http://127.0.0.1:8000/v1/chat/completions"));
        assert!(is_loopback("http://localhost/v1"));
        assert!(is_loopback("http://[::1]:80/v1"));
        assert!(is_loopback("http://user:pw@LOCALHOST:8000"));
        assert!(!is_loopback("https://api.openai.com/v1"));
        assert!(!is_loopback("http://10.0.0.2:8000/v1"));
        assert!(!is_loopback("http://localhost.example.com/v1"));
    }

    #[test]
    fn error_message_finds_the_servers_words() {
        assert_eq!(
            error_message(r#"{"error":{"message":"bad key","type":"x"}}"#),
            "bad key"
        );
        assert_eq!(
            error_message(r#"{"error":"model not loaded"}"#),
            "model not loaded"
        );
        assert_eq!(error_message(r#"{"detail":"Not Found"}"#), "Not Found");
        assert_eq!(error_message("  plain text  "), "plain text");
        assert!(error_message(&"x".repeat(1000)).chars().count() <= EXCERPT_CHARS + 1);
    }

    #[test]
    fn error_message_prefers_a_message_to_a_bare_error() {
        // A bare `error` is often only the status's name.
        assert_eq!(
            error_message(r#"{"error":"Bad Request","message":"max_tokens is too large"}"#),
            "max_tokens is too large"
        );
        assert_eq!(
            error_message(r#"{"error":{"code":7},"detail":"no such model"}"#),
            "no such model"
        );
        // Null values are skipped; a value that is not a string is shown as JSON.
        assert_eq!(error_message(r#"{"message":null,"detail":"d"}"#), "d");
        assert_eq!(error_message(r#"{"error":{"code":7}}"#), r#"{"code":7}"#);
        assert_eq!(error_message(r#"{"detail":[1,2]}"#), "[1,2]");
        assert_eq!(error_message(r#"{"other":1}"#), r#"{"other":1}"#);
        assert_eq!(error_message(""), "");
    }

    #[test]
    fn excerpts_are_trimmed_and_cut_on_characters() {
        assert_eq!(excerpt("  short \n"), "short");
        let long = "é".repeat(EXCERPT_CHARS + 5);
        let cut = excerpt(&long);
        assert_eq!(cut.chars().count(), EXCERPT_CHARS + 1);
        assert!(cut.ends_with('…'));
        assert_eq!(excerpt(&"é".repeat(EXCERPT_CHARS)), "é".repeat(EXCERPT_CHARS));
    }
}
