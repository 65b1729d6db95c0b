//! Cross-origin requests from browsers (CORS, as vLLM's `--allowed-origins`): which origins may
//! read the server's replies, and the headers that tell a browser so. With no origin allowed
//! (the default) no such header is sent, and browsers keep other sites' pages from reading the
//! replies; other clients are not concerned.

use super::listener::Request;

/// How long a browser may keep a preflight's answer, in seconds (vLLM's, through Starlette).
const PREFLIGHT_MAX_AGE: &str = "600";

/// The origins whose pages may read the server's replies (`--allowed-origins`): `*` for any.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllowedOrigins(Vec<String>);

impl AllowedOrigins {
    /// `origins` as given (`scheme://host[:port]`, or `*`); empty allows none.
    pub fn new(origins: Vec<String>) -> Self {
        Self(origins.into_iter().map(|o| o.trim().trim_end_matches('/').to_string()).filter(|o| !o.is_empty()).collect())
    }

    /// The `access-control-allow-origin` value for a page of `origin`, when it is allowed.
    fn allow(&self, origin: &str) -> Option<String> {
        if self.0.iter().any(|o| o == "*") {
            Some("*".into())
        } else {
            self.0.iter().any(|o| o == origin).then(|| origin.to_string())
        }
    }

    /// The headers of any reply to `request`: none unless it comes from an allowed origin.
    pub fn reply_headers(&self, request: &Request) -> Vec<(String, String)> {
        let Some(allowed) = request.header("origin").and_then(|origin| self.allow(origin)) else {
            return Vec::new();
        };
        let mut headers = Vec::new();
        if allowed != "*" {
            // The reply differs by origin: caches must not give one origin's to another.
            headers.push(("vary".to_string(), "Origin".to_string()));
        }
        headers.push(("access-control-allow-origin".to_string(), allowed));
        headers
    }

    /// The headers of the answer to a browser's preflight (`OPTIONS` with
    /// `Access-Control-Request-Method`) on a route taking `methods`: none unless its origin is
    /// allowed, else the reply's and what the route takes (any header the page asks to send,
    /// `Authorization` among them).
    pub fn preflight_headers(&self, request: &Request, methods: &str) -> Vec<(String, String)> {
        let mut headers = self.reply_headers(request);
        if headers.is_empty() || request.header("access-control-request-method").is_none() {
            return headers;
        }
        headers.push(("access-control-allow-methods".to_string(), methods.to_string()));
        if let Some(asked) = request.header("access-control-request-headers") {
            headers.push(("access-control-allow-headers".to_string(), asked.to_string()));
        }
        headers.push(("access-control-max-age".to_string(), PREFLIGHT_MAX_AGE.to_string()));
        headers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(headers: &[(&str, &str)]) -> Request {
        Request {
            method: "OPTIONS".into(),
            path: "/v1/chat/completions".into(),
            query: None,
            headers: headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect(),
            body: Vec::new(),
        }
    }

    fn value<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
        headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn no_origin_is_allowed_by_default() {
        let none = AllowedOrigins::default();
        let from_page = request(&[("origin", "https://example.com"), ("access-control-request-method", "POST")]);
        assert!(none.reply_headers(&from_page).is_empty());
        assert!(none.preflight_headers(&from_page, "POST, OPTIONS").is_empty());
    }

    #[test]
    fn an_allowed_origin_is_echoed_and_any_with_a_star() {
        let one = AllowedOrigins::new(vec!["http://localhost:3000/".into()]);
        let page = request(&[("origin", "http://localhost:3000")]);
        let headers = one.reply_headers(&page);
        assert_eq!(value(&headers, "access-control-allow-origin"), Some("http://localhost:3000"));
        assert_eq!(value(&headers, "vary"), Some("Origin"));
        assert!(one.reply_headers(&request(&[("origin", "https://evil.example")])).is_empty());
        assert!(one.reply_headers(&request(&[])).is_empty(), "no Origin: not a browser's cross-origin request");
        let any = AllowedOrigins::new(vec!["*".into()]);
        let headers = any.reply_headers(&request(&[("origin", "https://evil.example")]));
        assert_eq!(value(&headers, "access-control-allow-origin"), Some("*"));
        assert_eq!(value(&headers, "vary"), None);
    }

    #[test]
    fn a_preflight_learns_the_methods_and_may_send_its_headers() {
        let any = AllowedOrigins::new(vec!["*".into()]);
        let preflight = request(&[
            ("origin", "https://app.example"),
            ("access-control-request-method", "POST"),
            ("access-control-request-headers", "authorization, content-type"),
        ]);
        let headers = any.preflight_headers(&preflight, "POST, OPTIONS");
        assert_eq!(value(&headers, "access-control-allow-methods"), Some("POST, OPTIONS"));
        assert_eq!(value(&headers, "access-control-allow-headers"), Some("authorization, content-type"));
        assert_eq!(value(&headers, "access-control-max-age"), Some("600"));
    }
}
