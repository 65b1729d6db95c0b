//! OpenAI-style error replies: `{"error": {"message", "type", "param", "code"}}` with a 4xx or
//! 5xx status.

use serde_json::{json, Value};

/// An error answered to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 for a request that cannot be served as sent.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// The same error with a machine-readable code.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 400 naming the parameter and a machine-readable code.
    pub fn invalid_value(message: impl Into<String>, param: &str) -> Self {
        Self {
            code: Some("invalid_value"),
            ..Self::invalid(message, Some(param))
        }
    }

    /// 404 for a model this server does not serve.
    pub fn unknown_model(name: &str) -> Self {
        Self {
            status: 404,
            message: format!("The model `{name}` does not exist."),
            kind: "invalid_request_error",
            param: Some("model".to_string()),
            code: Some("model_not_found"),
        }
    }

    /// 404 for an unknown route.
    pub fn not_found(method: &str, path: &str) -> Self {
        Self {
            status: 404,
            code: Some("not_found"),
            ..Self::invalid(format!("Invalid URL ({method} {path})"), None)
        }
    }

    /// 405 for a known route with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self {
            status: 405,
            code: Some("method_not_allowed"),
            ..Self::invalid(format!("Method {method} is not allowed on {path}"), None)
        }
    }

    /// 401 for a request without the server's API key (`--api-key`), as vLLM answers it.
    pub fn unauthorized() -> Self {
        Self {
            status: 401,
            message: "Unauthorized: send the server's API key as `Authorization: Bearer KEY`."
                .to_string(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 499 (nginx's "client closed request", for the log only: nobody reads it) for a request
    /// whose client went away before its reply.
    pub fn client_gone() -> Self {
        Self {
            status: 499,
            message: "the client closed the connection".into(),
            kind: "client_closed_request",
            param: None,
            code: None,
        }
    }

    /// 500 for a failure on the server's side.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: 500,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_the_openai_shape() {
        let body = ApiError::invalid_value("bad", "temperature").body();
        assert_eq!(
            body,
            json!({"error": {"message": "bad", "type": "invalid_request_error",
                "param": "temperature", "code": "invalid_value"}})
        );
        let missing = ApiError::unknown_model("x");
        assert_eq!(
            (missing.status, missing.code),
            (404, Some("model_not_found"))
        );
    }
}
