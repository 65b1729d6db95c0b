//! `OUT/eval_setup.json`: what an eval's answers depend on (the mode, the agent, the large LLM,
//! the episode settings), so that a resume with other settings is refused instead of mixing two
//! setups' answers in one table. Only final answers bind: while every row so far failed (and is
//! run again anyway), a run may change the settings, e.g. a mistyped --env-url; and a run with
//! nothing left to answer (scoring again, with --ssim-model) is not checked.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

use super::Args;

/// The file's name in `--out`.
pub const SETUP_FILE: &str = "eval_setup.json";

/// The settings the answers of a run of `args` depend on, by flag name: the agent's only where
/// the mode uses it, the large LLM's likewise. Paths are written resolved, so that `ckpt`,
/// `ckpt/` and `./ckpt` are one setup.
pub fn setup_of(args: &Args) -> Map<String, Value> {
    let path = |p: &Option<std::path::PathBuf>| {
        p.as_ref().map(|p| {
            let resolved = p.canonicalize().or_else(|_| std::path::absolute(p)).unwrap_or_else(|_| p.clone());
            resolved.components().collect::<std::path::PathBuf>().display().to_string()
        })
    };
    let mut setup = Map::new();
    setup.insert("--mode".into(), json!(args.mode.name()));
    if args.mode.uses_agent() {
        let (agent, episode) = (&args.agent, &args.episode);
        let limits = episode.settings();
        for (flag, value) in [
            ("--agent", json!(path(&agent.agent))),
            ("--agent-url", json!(agent.agent_url)),
            ("--agent-model", json!(agent.agent_model)),
            ("--agent-api", json!(agent.agent_url.as_ref().map(|_| format!("{:?}", agent.agent_api)))),
            ("--dtype", json!(agent.agent.as_ref().map(|_| format!("{:?}", agent.dtype)))),
            ("--temperature", json!(agent.temperature)),
            ("--top-p", json!(agent.top_p)),
            ("--top-k", json!(agent.top_k)),
            ("--seed", json!(agent.seed)),
            ("--max-turns", json!(limits.max_turns)),
            ("--max-turn-tokens", json!(limits.max_turn_tokens)),
            ("--max-response-tokens", json!(limits.max_response_tokens)),
            ("--reply-chars", json!(limits.reply_chars)),
            ("--system-prompt", json!(path(&episode.system_prompt))),
            ("--instruction", json!(path(&episode.instruction))),
        ] {
            setup.insert(flag.into(), value);
        }
    }
    if args.mode.uses_env() {
        let env = &args.env;
        for (flag, value) in [
            ("--env-url", json!(env.env_url)),
            ("--env-model", json!(env.env_model)),
            ("--env-temperature", json!(env.env_temperature)),
            ("--env-top-p", json!(env.env_top_p)),
            ("--env-max-tokens", json!(env.env_max_tokens)),
            ("--env-seed", json!(env.env_seed)),
        ] {
            setup.insert(flag.into(), value);
        }
    }
    setup
}

/// Checks `setup` against the one `out` records where `out` holds final answers (`binding`),
/// refusing a resume with other settings (each difference named); records it otherwise.
pub fn check_or_record(out: &Path, setup: &Map<String, Value>, binding: bool) -> Result<()> {
    let path = out.join(SETUP_FILE);
    if !binding || !path.exists() {
        let text = format!("{}\n", serde_json::to_string_pretty(setup)?);
        return model::checkpoint::write_atomic(&path, text.as_bytes()).with_context(|| format!("cannot write {}", path.display()));
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let earlier: Map<String, Value> =
        serde_json::from_str(&text).with_context(|| format!("{} is not an eval's settings", path.display()))?;
    let shown = |v: Option<&Value>| match v {
        None | Some(Value::Null) => "(not given)".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    };
    let differences: Vec<String> = earlier
        .keys()
        .chain(setup.keys().filter(|k| !earlier.contains_key(*k)))
        .filter(|k| earlier.get(*k).unwrap_or(&Value::Null) != setup.get(*k).unwrap_or(&Value::Null))
        .map(|k| format!("{k} {} (now {})", shown(earlier.get(k)), shown(setup.get(k))))
        .collect();
    if !differences.is_empty() {
        bail!(
            "{} holds answers of another setup: {}. Resume with its settings, or use another --out",
            out.display(),
            differences.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_with_other_settings_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let setup = |agent: &str, seed: u64| {
            let mut map = Map::new();
            map.insert("--mode".into(), json!("agent"));
            map.insert("--agent".into(), json!(agent));
            map.insert("--seed".into(), json!(seed));
            map
        };
        check_or_record(dir.path(), &setup("/x", 0), false).unwrap();
        // Without final answers the settings may change.
        check_or_record(dir.path(), &setup("/a", 0), false).unwrap();
        check_or_record(dir.path(), &setup("/a", 0), true).unwrap();
        let err = check_or_record(dir.path(), &setup("/b", 1), true).unwrap_err().to_string();
        assert!(err.contains("--agent /a (now /b)") && err.contains("--seed 0 (now 1)") && err.contains("another --out"), "{err}");
        let mut direct = Map::new();
        direct.insert("--mode".into(), json!("direct"));
        let err = check_or_record(dir.path(), &direct, true).unwrap_err().to_string();
        assert!(err.contains("--mode agent (now direct)") && err.contains("--agent /a (now (not given))"), "{err}");
    }
}
