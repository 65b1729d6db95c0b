//! The API key: read from an environment variable, sent as a bearer token, never shown.

use std::fmt;

use crate::error::EnvError;

/// An API key. Its `Debug` output is redacted and it has no `Display` or `Serialize`.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// Wraps a key; an empty or blank key is `None`.
    pub fn new(key: impl Into<String>) -> Option<Self> {
        let key = key.into().trim().to_string();
        (!key.is_empty()).then_some(Self(key))
    }

    /// Reads the key from the environment variable `var`; unset or empty gives `None`.
    pub fn from_env(var: &str) -> Result<Option<Self>, EnvError> {
        match std::env::var(var) {
            Ok(key) => Ok(Self::new(key)),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(EnvError::Config(format!("${var} is not valid UTF-8")))
            }
        }
    }

    /// The `Authorization` header value: `Bearer <key>`.
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.0)
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_hides_the_key() {
        let key = ApiKey::new("sk-very-secret").unwrap();
        assert!(!format!("{key:?}").contains("sk-very-secret"));
        assert_eq!(key.bearer(), "Bearer sk-very-secret");
    }

    #[test]
    fn blank_keys_are_none() {
        assert!(ApiKey::new("  ").is_none());
        assert!(ApiKey::from_env("PROMPT_R1_TEST_SURELY_UNSET_VARIABLE")
            .unwrap()
            .is_none());
    }
}
