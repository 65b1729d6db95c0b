//! The routes that change the served policy at run time, as the trainer's rollout workers use
//! them: vLLM's runtime LoRA updating (`POST /v1/load_lora_adapter` with `lora_name`,
//! `lora_path`, `load_inplace`; `POST /v1/unload_lora_adapter` with `lora_name`) and SGLang's
//! `POST /update_weights_from_disk` (`model_path`: new base weights of the same config). The
//! change goes to the worker, which applies it once the requests before it have ended; the reply
//! comes when it has been applied (or refused, the policy unchanged).

use std::sync::mpsc;
use std::time::Instant;

use serde_json::{json, Map, Value};

use super::engine::{Control, Work};
use super::error::ApiError;
use super::http;
use super::listener::Responder;
use super::policy::Change;
use super::Shared;

pub(super) const LOAD_ADAPTER_ROUTE: &str = "/v1/load_lora_adapter";
pub(super) const UNLOAD_ADAPTER_ROUTE: &str = "/v1/unload_lora_adapter";
pub(super) const UPDATE_WEIGHTS_ROUTE: &str = "/update_weights_from_disk";
pub(super) const ROUTES: [&str; 3] = [LOAD_ADAPTER_ROUTE, UNLOAD_ADAPTER_ROUTE, UPDATE_WEIGHTS_ROUTE];

/// Answers one `POST` to `route` (one of [`ROUTES`]).
pub fn handle(body: &[u8], responder: Responder, route: &str, shared: &Shared) {
    let started = Instant::now();
    let outcome = change(route, body)
        .and_then(|change| apply(change, shared));
    let status = match &outcome {
        Ok(_) => 200,
        Err(err) => err.status,
    };
    http::log(route, shared, status, None, started);
    match (route, outcome) {
        (UPDATE_WEIGHTS_ROUTE, Ok(message)) => {
            http::respond_json(responder, 200, &json!({"success": true, "message": message}))
        }
        // SGLang's shape, with the OpenAI error beside it.
        (UPDATE_WEIGHTS_ROUTE, Err(err)) => {
            let mut body = err.body();
            body["success"] = json!(false);
            body["message"] = json!(err.message);
            http::respond_json(responder, err.status, &body)
        }
        // vLLM answers a load or unload with plain text.
        (_, Ok(message)) => http::respond_text(responder, 200, message),
        (_, Err(err)) => http::respond_error(responder, &err),
    }
}

/// The change a body asks for.
fn change(route: &str, body: &[u8]) -> Result<Change, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|err| {
        ApiError::invalid(format!("We could not parse the JSON body of your request ({err})."), None)
    })?;
    let Value::Object(fields) = value else {
        return Err(ApiError::invalid("The request body must be a JSON object.", None));
    };
    Ok(match route {
        LOAD_ADAPTER_ROUTE => Change::LoadAdapter {
            name: string(&fields, "lora_name")?,
            path: string(&fields, "lora_path")?,
            replace: match fields.get("load_inplace") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(other) => {
                    return Err(ApiError::invalid(
                        format!("Invalid type for 'load_inplace': expected a boolean, got {other}."),
                        Some("load_inplace"),
                    )
                    .with_code("invalid_type"))
                }
            },
        },
        UNLOAD_ADAPTER_ROUTE => Change::UnloadAdapter {
            name: string(&fields, "lora_name")?,
        },
        _ => Change::UpdateWeights {
            path: string(&fields, "model_path")?,
        },
    })
}

/// The non-empty string `fields[key]`.
fn string(fields: &Map<String, Value>, key: &str) -> Result<String, ApiError> {
    match fields.get(key) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::String(_)) => Err(ApiError::invalid_value(format!("'{key}' is empty."), key)),
        None | Some(Value::Null) => Err(ApiError::invalid(
            format!("Missing required parameter: '{key}'."),
            Some(key),
        )
        .with_code("missing_required_parameter")),
        Some(other) => Err(ApiError::invalid(
            format!("Invalid type for '{key}': expected a string, got {other}."),
            Some(key),
        )
        .with_code("invalid_type")),
    }
}

/// Hands `change` to the worker and waits until it has been applied or refused.
fn apply(change: Change, shared: &Shared) -> Result<String, ApiError> {
    let (reply, outcome) = mpsc::channel();
    shared
        .work
        .send(Work::Control(Control { change, reply }))
        .map_err(|_| ApiError::internal("the generation worker has stopped"))?;
    outcome
        .recv()
        .map_err(|_| ApiError::internal("the generation worker stopped before applying the change"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_each_change_and_names_the_bad_parameter() {
        let load = br#"{"lora_name": "policy", "lora_path": "/a/b", "load_inplace": true}"#;
        assert_eq!(
            change(LOAD_ADAPTER_ROUTE, load).unwrap(),
            Change::LoadAdapter {
                name: "policy".into(),
                path: "/a/b".into(),
                replace: true
            }
        );
        let plain = br#"{"lora_name": "p", "lora_path": "d", "load_inplace": null}"#;
        assert!(matches!(change(LOAD_ADAPTER_ROUTE, plain).unwrap(), Change::LoadAdapter { replace: false, .. }));
        assert_eq!(
            change(UNLOAD_ADAPTER_ROUTE, br#"{"lora_name": "p"}"#).unwrap(),
            Change::UnloadAdapter { name: "p".into() }
        );
        assert_eq!(
            change(UPDATE_WEIGHTS_ROUTE, br#"{"model_path": "/m", "flush_cache": true}"#).unwrap(),
            Change::UpdateWeights { path: "/m".into() }
        );
        let param = |route: &str, body: &str| change(route, body.as_bytes()).unwrap_err().param;
        assert_eq!(param(LOAD_ADAPTER_ROUTE, r#"{"lora_path": "d"}"#).as_deref(), Some("lora_name"));
        assert_eq!(param(LOAD_ADAPTER_ROUTE, r#"{"lora_name": "p"}"#).as_deref(), Some("lora_path"));
        assert_eq!(param(LOAD_ADAPTER_ROUTE, r#"{"lora_name": "p", "lora_path": 3}"#).as_deref(), Some("lora_path"));
        assert_eq!(
            param(LOAD_ADAPTER_ROUTE, r#"{"lora_name": "p", "lora_path": "d", "load_inplace": "yes"}"#).as_deref(),
            Some("load_inplace")
        );
        assert_eq!(param(UNLOAD_ADAPTER_ROUTE, r#"{"lora_name": ""}"#).as_deref(), Some("lora_name"));
        assert_eq!(param(UPDATE_WEIGHTS_ROUTE, r#"{}"#).as_deref(), Some("model_path"));
        assert_eq!(param(UPDATE_WEIGHTS_ROUTE, "[1]"), None);
        assert_eq!(change(UPDATE_WEIGHTS_ROUTE, b"{").unwrap_err().status, 400);
    }
}
