//! `OUT/eval_setup.json`: what an eval's answers depend on (the mode, the agent and what its
//! weights and prompt files hold, the large LLM, the episode settings), so that a resume with
//! other settings is refused instead of mixing two setups' answers in one table. Only final
//! answers bind: while every row so far failed (and is run again anyway), a run may change the
//! settings, e.g. a mistyped --env-url. A run with nothing left to answer (scoring again, with
//! --ssim-model) keeps the recorded setup, and notes where the flags given differ from it.

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
        // What the files hold, so that a model exported again to the same folder, or an edited
        // prompt file, counts as another setup.
        let weights = agent.agent.as_deref().and_then(|dir| crate::model_dir::resolve_agent(dir).ok()).and_then(|resolved| {
            let fingerprint = |dir: &Path| trainer::run::BaseModel::of(dir).map(|m| m.fingerprint);
            match &resolved.adapter {
                None => fingerprint(&resolved.model),
                Some(adapter) => Some(format!("{}+{}", fingerprint(&resolved.model)?, fingerprint(adapter)?)),
            }
        });
        let text = |p: &Option<std::path::PathBuf>| {
            p.as_ref().and_then(|p| std::fs::read(p).ok()).map(|bytes| trainer::run::fingerprint_of(&bytes))
        };
        for (key, value) in [
            ("--agent's weights", json!(weights)),
            ("--system-prompt's text", json!(text(&episode.system_prompt))),
            ("--instruction's text", json!(text(&episode.instruction))),
        ] {
            setup.insert(key.into(), value);
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

/// The setup `out` records, if it records one.
pub fn recorded(out: &Path) -> Result<Option<Map<String, Value>>> {
    let path = out.join(SETUP_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let earlier = serde_json::from_str(&text).with_context(|| format!("{} is not an eval's settings", path.display()))?;
    Ok(Some(earlier))
}

/// Where `now` differs from `earlier`, each as "FLAG EARLIER (now NOW)". A key `earlier` lacks
/// (recorded by a version that did not record it) is not compared.
pub fn differences(earlier: &Map<String, Value>, now: &Map<String, Value>) -> Vec<String> {
    let shown = |v: Option<&Value>| match v {
        None | Some(Value::Null) => "(not given)".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    };
    earlier
        .keys()
        .filter(|k| earlier.get(*k).unwrap_or(&Value::Null) != now.get(*k).unwrap_or(&Value::Null))
        .map(|k| format!("{k} {} (now {})", shown(earlier.get(k)), shown(now.get(k))))
        .collect()
}

/// Checks `setup` against the one `out` records where `out` holds final answers (`binding`),
/// refusing a resume with other settings (each difference named); records it otherwise.
pub fn check_or_record(out: &Path, setup: &Map<String, Value>, binding: bool) -> Result<()> {
    let path = out.join(SETUP_FILE);
    if binding {
        if let Some(earlier) = recorded(out)? {
            let differences = differences(&earlier, setup);
            if !differences.is_empty() {
                bail!(
                    "{} holds answers of another setup: {}. Resume with its settings, or use another --out",
                    out.display(),
                    differences.join(", ")
                );
            }
        }
    }
    let text = format!("{}\n", serde_json::to_string_pretty(setup)?);
    model::checkpoint::write_atomic(&path, text.as_bytes()).with_context(|| format!("cannot write {}", path.display()))
}

/// The name of a run of `setup` in the paper table: its mode, and the large LLM where it has one.
pub fn run_label(setup: &Map<String, Value>) -> String {
    let mode = setup.get("--mode").and_then(Value::as_str).unwrap_or("?");
    match setup.get("--env-model").and_then(Value::as_str) {
        Some(model) => format!("this run ({mode}, {model})"),
        None => format!("this run ({mode})"),
    }
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
        // A key the record lacks (an earlier version's) binds from the next record on.
        let mut more = setup("/a", 0);
        more.insert("--agent's weights".into(), json!("00ff"));
        check_or_record(dir.path(), &more, true).unwrap();
        more.insert("--agent's weights".into(), json!("11ee"));
        let err = check_or_record(dir.path(), &more, true).unwrap_err().to_string();
        assert!(err.contains("--agent's weights 00ff (now 11ee)"), "{err}");
    }

    /// The setup holds what the agent's folder and the prompt files hold: the same paths with
    /// other weights or text are another setup.
    #[test]
    fn the_setup_holds_the_agents_weights_and_the_prompt_texts() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let dir = tempfile::tempdir().unwrap();
        let agent = dir.path().join("agent");
        std::fs::create_dir_all(&agent).unwrap();
        std::fs::write(agent.join("config.json"), "{}").unwrap();
        std::fs::write(agent.join("model.safetensors"), vec![1u8; 4096]).unwrap();
        let instruction = dir.path().join("instruction.txt");
        std::fs::write(&instruction, "Ask, then answer.").unwrap();
        let (agent_arg, instruction_arg) = (agent.to_str().unwrap(), instruction.to_str().unwrap());
        let setup = || {
            let cli = Cli::try_parse_from(["eval", "--data", "x.csv", "--out", "o", "--agent", agent_arg, "--instruction", instruction_arg]).unwrap();
            setup_of(&cli.args)
        };
        let first = setup();
        assert!(first["--agent's weights"].is_string() && first["--instruction's text"].is_string(), "{first:?}");
        assert!(first["--system-prompt's text"].is_null());
        assert!(differences(&first, &setup()).is_empty());
        std::fs::write(&instruction, "Ask twice, then answer.").unwrap();
        assert_eq!(differences(&first, &setup()).len(), 1);
        std::fs::write(agent.join("model.safetensors"), vec![2u8; 4096]).unwrap();
        let changed = differences(&first, &setup());
        assert!(changed.len() == 2 && changed.iter().any(|d| d.starts_with("--agent's weights")), "{changed:?}");
    }

    /// The table's label comes from a setup, with the large LLM where it has one.
    #[test]
    fn the_label_names_the_mode_and_the_large_llm() {
        let mut map = Map::new();
        map.insert("--mode".into(), json!("agent"));
        assert_eq!(run_label(&map), "this run (agent)");
        map.insert("--env-model".into(), json!("gpt-4o-mini"));
        assert_eq!(run_label(&map), "this run (agent, gpt-4o-mini)");
    }
}
