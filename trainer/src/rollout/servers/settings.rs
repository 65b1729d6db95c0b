//! `[rollout.servers]`: the rollout workers and how the trainer talks to them.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The workers of `engine = "servers"` (the `[rollout.servers]` table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSettings {
    /// The workers' base URLs (`http://host:port`, with or without a final `/v1`).
    pub urls: Vec<String>,
    /// Most seconds one completion request may take (connecting, waiting, reading).
    pub request_timeout_secs: u64,
    /// Most seconds a worker may take to load a new policy (and list its models after).
    pub sync_timeout_secs: u64,
    /// The environment variable holding the workers' API key, sent as a bearer token (unset:
    /// no key is sent; named but empty or unset in the environment: an error at start).
    pub api_key_env: Option<String>,
    /// The name LoRA runs load their adapters under (`lora_name`) and ask for in requests.
    pub adapter_name: String,
    /// The served base model's name that full fine-tuning runs ask for (unset: each worker's
    /// first entry of `GET /v1/models`).
    pub model_name: Option<String>,
    /// Where the policy of each step is written for the workers to load (a path they can read;
    /// the newest two are kept). Unset: `<run.out_dir>/policy`.
    pub policy_dir: Option<PathBuf>,
}

impl Default for ServerSettings {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            request_timeout_secs: 600,
            sync_timeout_secs: 1800,
            api_key_env: None,
            adapter_name: "policy".into(),
            model_name: None,
            policy_dir: None,
        }
    }
}

impl ServerSettings {
    /// Checks every key; the message names it (`rollout.servers.<key>`).
    pub fn validate(&self) -> Result<(), model::SettingError> {
        self.base_urls()?;
        if self.request_timeout_secs == 0 {
            return Err("rollout.servers.request_timeout_secs must be at least 1".into());
        }
        if self.sync_timeout_secs == 0 {
            return Err("rollout.servers.sync_timeout_secs must be at least 1".into());
        }
        if let Some(var) = &self.api_key_env {
            if var.is_empty() || var.contains(['=', '\0']) {
                return Err(format!("rollout.servers.api_key_env: {var:?} is not an environment variable name").into());
            }
        }
        if self.adapter_name.trim().is_empty() {
            return Err("rollout.servers.adapter_name must not be empty".into());
        }
        if self.model_name.as_deref().is_some_and(|name| name.trim().is_empty()) {
            return Err("rollout.servers.model_name must not be empty (leave it out to ask each worker)".into());
        }
        Ok(())
    }

    /// The workers' URLs without a final `/` or `/v1`, checked: at least one, each `http://` or
    /// `https://` with a host, none twice.
    pub fn base_urls(&self) -> Result<Vec<String>, model::SettingError> {
        if self.urls.is_empty() {
            return Err("rollout.servers.urls names no worker".into());
        }
        let mut out: Vec<String> = Vec::with_capacity(self.urls.len());
        for url in &self.urls {
            let base = normalise_url(url).map_err(|reason| format!("rollout.servers.urls: {url:?} {reason}"))?;
            if out.contains(&base) {
                return Err(format!("rollout.servers.urls names {base} twice").into());
            }
            out.push(base);
        }
        Ok(out)
    }
}

/// `url` without surrounding space, a final `/` or a final `/v1`.
fn normalise_url(url: &str) -> Result<String, &'static str> {
    let url = url.trim();
    let scheme = ["http://", "https://"]
        .into_iter()
        .find(|s| url.starts_with(s))
        .ok_or("is not an http:// or https:// URL")?;
    let mut rest = url[scheme.len()..].trim_end_matches('/');
    if let Some(root) = rest.strip_suffix("/v1") {
        rest = root.trim_end_matches('/');
    }
    if rest.is_empty() || rest.starts_with('/') {
        return Err("has no host");
    }
    if rest.contains(['?', '#', ' ']) {
        return Err("must be a plain base URL (no query, fragment or spaces)");
    }
    Ok(format!("{scheme}{rest}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_normalised_and_checked() {
        let settings = |urls: &[&str]| ServerSettings { urls: urls.iter().map(|u| u.to_string()).collect(), ..Default::default() };
        let ok = settings(&["http://a:8000", "http://b:8000/", "https://c/v1", " http://d:1/v1/ "]);
        assert_eq!(ok.base_urls().unwrap(), ["http://a:8000", "http://b:8000", "https://c", "http://d:1"]);
        assert!(ok.validate().is_ok());
        for (urls, needle) in [
            (&[][..], "names no worker"),
            (&["a:8000"][..], "http://"),
            (&["http://"][..], "no host"),
            (&["http://a/v1", "http://a"][..], "twice"),
        ] {
            let err = settings(urls).validate().unwrap_err();
            assert!(err.0.contains("rollout.servers.urls") && err.0.contains(needle), "{urls:?}: {err}");
        }
        let zero = ServerSettings { request_timeout_secs: 0, ..settings(&["http://a"]) };
        assert!(zero.validate().unwrap_err().0.contains("rollout.servers.request_timeout_secs"));
        let key = ServerSettings { api_key_env: Some("A=B".into()), ..settings(&["http://a"]) };
        assert!(key.validate().unwrap_err().0.contains("rollout.servers.api_key_env"));
    }
}
