//! The rollout workers, which of them are usable, and the pushing of a policy to them.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::http::{api_key_from_env, parse_models, Failure, Worker};
use super::settings::ServerSettings;

/// Which kind of policy the workers are given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PolicyKind {
    /// LoRA adapters loaded under this name (`/v1/load_lora_adapter`); requests ask for it.
    Adapter(String),
    /// Full weights (`/update_weights_from_disk`); requests ask for the served model's name.
    Full,
}

/// One worker and what the trainer knows of it.
#[derive(Debug)]
pub(crate) struct Slot {
    pub worker: Worker,
    /// The `model` its requests name (the adapter, or its served base model; empty until known).
    pub model: String,
    /// Why it is not used, if it is not: it failed during a rollout, or did not take the
    /// newest policy. Cleared when it takes a policy.
    pub down: Option<String>,
    /// Episodes assigned to it and not yet over.
    pub episodes: usize,
}

/// The rollout workers of a run (`[rollout.servers]`).
#[derive(Debug)]
pub struct ServerPool {
    pub(crate) slots: Vec<Slot>,
    pub(crate) kind: PolicyKind,
    /// Turns sent again to another worker after one failed, over the pool's life.
    pub(crate) retries: u64,
    pub(crate) request_timeout: Duration,
    pub(crate) sync_timeout: Duration,
}

impl ServerPool {
    /// The workers of `settings` (validated here), for a LoRA run when `lora`. Reads the API key
    /// from `api_key_env`, if named. Contacts no worker.
    pub fn new(settings: &ServerSettings, lora: bool) -> Result<Self, model::SettingError> {
        settings.validate()?;
        let key = settings.api_key_env.as_deref().map(api_key_from_env).transpose()?.map(Arc::new);
        let kind = if lora { PolicyKind::Adapter(settings.adapter_name.clone()) } else { PolicyKind::Full };
        let model = match &kind {
            PolicyKind::Adapter(name) => name.clone(),
            PolicyKind::Full => settings.model_name.clone().unwrap_or_default(),
        };
        let slots = settings
            .base_urls()?
            .into_iter()
            .map(|base| Slot { worker: Worker::new(base, key.clone()), model: model.clone(), down: None, episodes: 0 })
            .collect();
        Ok(Self {
            slots,
            kind,
            retries: 0,
            request_timeout: Duration::from_secs(settings.request_timeout_secs),
            sync_timeout: Duration::from_secs(settings.sync_timeout_secs),
        })
    }

    /// The workers' base URLs, in order.
    pub fn urls(&self) -> Vec<&str> {
        self.slots.iter().map(|s| s.worker.base()).collect()
    }

    /// Turns sent again to another worker after one failed, since the pool was made.
    pub fn retries(&self) -> u64 {
        self.retries
    }

    /// How many workers are usable.
    pub fn live(&self) -> usize {
        self.slots.iter().filter(|s| s.down.is_none()).count()
    }

    /// The usable worker with the fewest episodes (the first of those tied).
    pub(crate) fn pick(&self) -> Option<usize> {
        (0..self.slots.len()).filter(|&i| self.slots[i].down.is_none()).min_by_key(|&i| self.slots[i].episodes)
    }

    /// Leaves worker `i` out (keeping the first reason it failed).
    pub(crate) fn mark_down(&mut self, i: usize, reason: String) {
        self.slots[i].down.get_or_insert(reason);
    }

    /// The workers not in use, each as `url (why)`.
    pub fn left_out(&self) -> Vec<String> {
        self.slots.iter().filter_map(|s| s.down.as_ref().map(|why| format!("{} ({why})", s.worker.base()))).collect()
    }

    /// Every worker's state, for an error once none is left: `url: why; url: why`.
    pub(crate) fn describe_failures(&self) -> String {
        self.slots
            .iter()
            .map(|s| format!("{} ({})", s.worker.base(), s.down.as_deref().unwrap_or("usable")))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Has every worker load the policy in the directory `path` (absolute), and checks with
    /// `GET /v1/models` that each now serves it from there; LoRA adapters also on the run's
    /// `base` model, where the worker's base is a directory on this machine. A worker that fails
    /// is left out until it takes a later policy; one that had been left out and takes this one
    /// is used again. An error when no worker took it (naming each worker's failure).
    pub(crate) fn push_policy(&mut self, path: &Path, base: &Path) -> Result<(), String> {
        let kind = &self.kind;
        let timeout = self.sync_timeout;
        std::thread::scope(|scope| {
            for slot in self.slots.iter_mut() {
                scope.spawn(move || match push_to(slot, kind, path, base, timeout) {
                    Ok(()) => slot.down = None,
                    Err(reason) => slot.down = Some(format!("did not take the policy {}: {reason}", path.display())),
                });
            }
        });
        if self.live() == 0 {
            return Err(format!("no rollout worker took the policy {}: {}", path.display(), self.describe_failures()));
        }
        Ok(())
    }
}

/// Loads the policy at `path` on one worker and checks that it serves it (adapters on `base`).
fn push_to(slot: &mut Slot, kind: &PolicyKind, path: &Path, base: &Path, timeout: Duration) -> Result<(), String> {
    let shown = path.to_string_lossy();
    let worker = &slot.worker;
    match kind {
        PolicyKind::Adapter(name) => {
            let body = json!({"lora_name": name, "lora_path": shown, "load_inplace": true});
            worker.post("/v1/load_lora_adapter", body.to_string().as_bytes(), timeout).map_err(|f| f.message().to_string())?;
        }
        PolicyKind::Full => {
            let body = json!({"model_path": shown});
            let reply = worker.post("/update_weights_from_disk", body.to_string().as_bytes(), timeout).map_err(|f| f.message().to_string())?;
            // SGLang answers {"success": false, "message"} on a failed load.
            if let Ok(value) = serde_json::from_str::<serde_json::Value>(&reply) {
                if value.get("success") == Some(&serde_json::Value::Bool(false)) {
                    let message = value.get("message").and_then(|m| m.as_str()).unwrap_or("no message");
                    return Err(format!("{}/update_weights_from_disk: the load failed: {message}", worker.base()));
                }
            }
        }
    }
    let url = format!("{}/v1/models", worker.base());
    let body = worker.get("/v1/models", timeout).map_err(|f: Failure| f.message().to_string())?;
    let models = parse_models(&body).map_err(|e| format!("{url}: {e}"))?;
    let entry = match kind {
        PolicyKind::Adapter(name) => models.iter().find(|m| &m.id == name),
        PolicyKind::Full if slot.model.is_empty() => models.iter().find(|m| m.parent.is_none()).or(models.first()),
        PolicyKind::Full => models.iter().find(|m| m.id == slot.model),
    };
    let wanted = match kind {
        PolicyKind::Adapter(name) => format!("adapter {name:?}"),
        PolicyKind::Full if slot.model.is_empty() => "base model".to_string(),
        PolicyKind::Full => format!("model {:?}", slot.model),
    };
    let entry = entry.ok_or_else(|| format!("{url} lists no {wanted}"))?;
    let root = entry.root.as_deref().unwrap_or("");
    if !same_path(root, path) {
        return Err(format!("{url}: the {wanted} is served from {root:?}, not the policy just pushed"));
    }
    if let PolicyKind::Adapter(name) = kind {
        // The adapter applies to whatever base the worker holds, and a full fine-tuning run's
        // pushes replace that base with its policies: a worker whose base is such a policy, not
        // the run's model, would sample from the wrong weights. Other bases (the model as the
        // worker was started on it: a path of its own host, a hub id) cannot be told apart from
        // the run's from here, and are taken.
        let parent = entry.parent.as_deref().and_then(|id| models.iter().find(|m| m.id == id));
        if let Some(root) = parent.and_then(|m| m.root.as_deref()) {
            if is_pushed_policy(Path::new(root), path) && !same_path(root, base) {
                return Err(format!(
                    "{url}: the adapter {name:?} would run on a policy pushed by an earlier run ({root:?}), not on \
                     the run's model {}: restart the worker with `--model {}`",
                    base.display(),
                    base.display()
                ));
            }
        }
    }
    if *kind == PolicyKind::Full && slot.model.is_empty() {
        slot.model = entry.id.clone();
    }
    Ok(())
}

/// Whether a worker's base `root` is a policy a trainer pushed: an absolute path named as a
/// step's policy (`step-NNNNNNN`), or beside the policy `pushed` now.
fn is_pushed_policy(root: &Path, pushed: &Path) -> bool {
    let named = root.file_name().and_then(|n| n.to_str()).is_some_and(|n| crate::run::checkpoint::checkpoint_step(n).is_some());
    root.is_absolute() && (named || root.parent() == pushed.parent())
}

/// Whether the `root` a worker reports is `path` (as written, or after resolving links).
fn same_path(root: &str, path: &Path) -> bool {
    if root.is_empty() {
        return false;
    }
    let root = Path::new(root.trim_end_matches('/'));
    root == path || matches!((root.canonicalize(), path.canonicalize()), (Ok(a), Ok(b)) if a == b)
}
