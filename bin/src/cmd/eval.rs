//! `prompt-r1 eval`: answer every question of one or more datasets, append the predictions as
//! they come, and score them per data source.

mod modes;
mod paper;
mod predictions;
mod scoring;
mod setup;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args as ClapArgs, ValueEnum};
use data::{Example, OnBadRow};
use env::{
    run_episodes_admitted, Admission, ChatMessage, EnvError, Environment, EpisodeObserver,
    ParallelRunner, Trajectory,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use crate::agent_flags::{AgentFlags, EnvFlags, EpisodeFlags};
use modes::Mode;
use predictions::{key_of, Key, PredictionsFile, Row};

/// Evaluate on datasets: predictions.jsonl, metrics.json and the metrics table.
///
/// Every question of the --data files (CSV, JSONL or verl parquet) is answered, --batch-size at a
/// time (with the agent: the next question beginning as soon as one ends); each answer is
/// appended to OUT/predictions.jsonl as one line {"id", "data_source", "question", "prediction",
/// "answers", "mode", "stop_reason", "failed", "error", "trajectory"} as soon as it is done. Run the same command again to resume: rows
/// already in the file are not redone (failed ones are, and those of edited examples); a resume
/// with another agent (its folder, or the weights in it), sampling, episode limits, prompt
/// texts or large LLM is refused (OUT/eval_setup.json records them). The end prints
/// EM, SM, F1 (and SSim with --ssim-model) ×100 per data source and their mean, also written to
/// OUT/metrics.json, and laid out like the paper's Tables 1 and 2 (each data set with the
/// paper's two metrics, in its order, its Average lines, the published GPT-4o-mini and
/// Prompt-R1 figures beside this run's with the difference to each) in OUT/paper_table.md and
/// OUT/paper_table.json (printed with --paper-table).
///
/// Modes (the paper's comparison rows): `agent` — the agent prompts the large LLM, then answers;
/// `direct` — the large LLM gets the bare question; `cot` — the large LLM is asked to think step
/// by step and answer in <answer></answer>; `agent-only` — the agent alone with that
/// instruction and no calls allowed. `direct` and `cot` need no agent, `agent-only` no large
/// LLM. Failed episodes (the large LLM unreachable after retries, ...) score 0 and are counted.
#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// Dataset files (.csv, .jsonl, .parquet); give several after one --data or repeat it.
    #[arg(long, value_name = "FILE", num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    /// Output directory for predictions.jsonl and metrics.json (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// How questions are answered.
    #[arg(long, value_enum, default_value = "agent")]
    pub mode: Mode,
    /// Take at most N questions from each file (its first N).
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Questions run together (one batched generation per agent turn; their calls to the
    /// large LLM in parallel).
    #[arg(long, value_name = "B", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: u64,
    /// When the agent's next questions begin: `continuous` (as soon as one ends, at most
    /// --batch-size in flight, as an inference engine admits requests) or `batches` (--batch-size
    /// at a time, each batch waiting for its longest episode). Greedy answers are the same
    /// either way, but for ties within floating-point rounding.
    #[arg(long, value_enum, default_value = "continuous")]
    pub admission: EvalAdmission,
    /// all-MiniLM-L6-v2 folder (config.json, tokenizer.json, model.safetensors): adds SSim.
    #[arg(long, value_name = "DIR")]
    pub ssim_model: Option<PathBuf>,
    /// Also print the results laid out like the paper's Tables 1 and 2, beside its published
    /// GPT-4o-mini and Prompt-R1 figures (always written to OUT/paper_table.md and
    /// OUT/paper_table.json).
    #[arg(long)]
    pub paper_table: bool,
    /// What to do with a malformed dataset row: fail or skip.
    #[arg(long, value_name = "POLICY", default_value_t = OnBadRow::Fail)]
    pub on_bad_row: OnBadRow,
    #[command(flatten)]
    pub agent: AgentFlags,
    #[command(flatten)]
    pub env: EnvFlags,
    #[command(flatten)]
    pub episode: EpisodeFlags,
}

pub fn run(mut args: Args) -> Result<()> {
    args.agent.apply_preset(args.episode.preset);
    let mode = args.mode;
    if mode.uses_agent() && !args.agent.is_given() {
        bail!(
            "--mode {} needs the agent: --agent DIR, or --agent-url URL --agent-model NAME",
            mode.name()
        );
    }
    if !mode.uses_agent() && args.agent.is_given() {
        eprintln!("note: --mode {} does not use the agent", mode.name());
    }
    if !mode.uses_env() && args.env.is_given() {
        eprintln!("note: --mode {} does not call the large LLM", mode.name());
    }
    let selected = load_examples(&args.data, args.limit, args.on_bad_row)?;
    if let Some(dir) = &args.ssim_model {
        scoring::check_ssim_model(dir)?;
    }
    // A mistyped agent leaves no new --out behind (a run with nothing left to answer needs it
    // not at all).
    if let Some(dir) = args.agent.agent.as_deref().filter(|_| mode.uses_agent() && !args.out.exists()) {
        crate::model_dir::resolve_agent(dir).with_context(|| format!("--agent {}", dir.display()))?;
    }
    // A new --out is made only once the large LLM answers, so that a run that cannot start
    // leaves none behind.
    let fresh_out = !args.out.exists();
    if fresh_out && mode.uses_env() && !selected.is_empty() {
        args.env.probe(&format!("--mode {}", mode.name()))?;
    }
    super::create_dir(&args.out)?;
    // Two evals answering into one --out would both answer every question.
    let _lock = trainer::run::lock_dir(&args.out, "--out")?;
    let predictions_path = args.out.join("predictions.jsonl");
    let (mut file, done) = PredictionsFile::open(&predictions_path)?;
    let shown = predictions_path.display().to_string();
    if let Err(err) = ctrlc::set_handler(move || {
        eprintln!("\ninterrupted: every answer finished so far is in {shown}; run the same command again to go on from there");
        std::process::exit(130);
    }) {
        eprintln!("note: an interruption will end the run without a word ({err})");
    }
    if let Some(other) = done.values().find(|row| row.mode != mode) {
        bail!(
            "{} holds predictions of --mode {}; use another --out for --mode {}",
            predictions_path.display(),
            other.mode.name(),
            mode.name()
        );
    }
    let todo: Vec<&Example> = selected
        .iter()
        .filter(|e| done.get(&key_of(e)).is_none_or(|row| !row.answers_for(e)))
        .collect();
    let given = setup::setup_of(&args);
    let setup = if todo.is_empty() {
        match setup::recorded(&args.out)? {
            Some(earlier) => {
                let differences = setup::differences(&earlier, &given);
                if !differences.is_empty() {
                    eprintln!(
                        "note: nothing is left to answer, so these flags change nothing; the answers were made with {}",
                        differences.join(", ")
                    );
                }
                earlier
            }
            None => given,
        }
    } else {
        setup::check_or_record(&args.out, &given, done.values().any(Row::is_final))?;
        given
    };
    if mode.uses_env() && !todo.is_empty() && !fresh_out {
        args.env.probe(&format!("--mode {}", mode.name()))?;
    }
    let progress = progress_bar(selected.len(), selected.len() - todo.len(), mode);
    let batch_size = args.batch_size as usize;
    let outcome = if todo.is_empty() {
        Ok(RunCounts::default())
    } else if mode.uses_agent() {
        run_agent(&args, &todo, batch_size, &mut file, &progress)
    } else {
        run_llm(&args, &todo, batch_size, &mut file, &progress)
    };
    progress.finish_and_clear();
    let counts = outcome?;
    drop(file);

    let (_, rows) = PredictionsFile::open(&predictions_path)?;
    let finished: Vec<&Row> = selected
        .iter()
        .filter_map(|e| rows.get(&key_of(e)).filter(|row| row.is_of(e)))
        .collect();
    if finished.len() != selected.len() {
        bail!(
            "{} lacks {} of the {} selected questions",
            predictions_path.display(),
            selected.len() - finished.len(),
            selected.len()
        );
    }
    let report = scoring::report(&finished, args.ssim_model.as_deref(), args.agent.device)?;
    let mut stop_reasons: BTreeMap<String, usize> = BTreeMap::new();
    for row in &finished {
        let reason = serde_json::to_value(row.stop_reason)?;
        *stop_reasons
            .entry(reason.as_str().unwrap_or_default().to_string())
            .or_default() += 1;
    }
    let failed = finished.iter().filter(|row| row.failed).count();
    let mut metrics = serde_json::to_value(&report)?;
    metrics["mode"] = json!(mode.name());
    metrics["preset"] = json!(args
        .episode
        .preset
        .to_possible_value()
        .map(|v| v.get_name().to_string()));
    metrics["failed"] = json!(failed);
    metrics["stop_reasons"] = json!(stop_reasons);
    let metrics_path = args.out.join("metrics.json");
    let text = format!("{}\n", serde_json::to_string_pretty(&metrics)?);
    model::checkpoint::write_atomic(&metrics_path, text.as_bytes())
        .with_context(|| format!("cannot write {}", metrics_path.display()))?;

    let paper = paper::PaperSpec::reference()?.table(&report, &setup::run_label(&setup));
    let paper_md = args.out.join("paper_table.md");
    let paper_json = args.out.join("paper_table.json");
    model::checkpoint::write_atomic(&paper_md, paper.markdown().as_bytes())
        .with_context(|| format!("cannot write {}", paper_md.display()))?;
    let text = format!("{}\n", serde_json::to_string_pretty(&paper)?);
    model::checkpoint::write_atomic(&paper_json, text.as_bytes())
        .with_context(|| format!("cannot write {}", paper_json.display()))?;

    print!("{report}");
    if args.paper_table {
        println!();
        print!("{}", paper.markdown());
        println!();
    }
    let reasons: Vec<String> = stop_reasons
        .iter()
        .map(|(r, n)| format!("{r} {n}"))
        .collect();
    println!(
        "{} questions, mode {}: {} answered now, {} from earlier runs; stop reasons: {}",
        finished.len(),
        mode.name(),
        counts.run,
        selected.len() - todo.len(),
        reasons.join(", ")
    );
    if failed > 0 {
        println!(
            "{failed} failed (scored 0); failed rows are run again by the next eval with the same --out"
        );
    }
    println!(
        "wrote {}, {}, {} and {}",
        predictions_path.display(),
        metrics_path.display(),
        paper_md.display(),
        paper_json.display()
    );
    if counts.run > 0 && counts.failed == counts.run {
        bail!(
            "every question of this run failed; first error: {}",
            counts.first_error.as_deref().unwrap_or("unknown")
        );
    }
    Ok(())
}

/// Loads the files in order, at most `limit` examples from each, dropping repeated keys.
fn load_examples(
    paths: &[PathBuf],
    limit: Option<usize>,
    on_bad_row: OnBadRow,
) -> Result<Vec<Example>> {
    let mut selected = Vec::new();
    let mut seen = HashMap::new();
    let mut repeated = 0;
    let mut differing: Vec<Key> = Vec::new();
    for path in paths {
        // Every `DataError` names the file already.
        let dataset = data::load(path, on_bad_row)?;
        if !dataset.skipped().is_empty() {
            eprintln!(
                "note: skipped {} malformed rows of {}",
                dataset.skipped().len(),
                path.display()
            );
        }
        for example in dataset
            .into_examples()
            .into_iter()
            .take(limit.unwrap_or(usize::MAX))
        {
            match seen.entry(key_of(&example)) {
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert(example.question().to_string());
                    selected.push(example);
                }
                std::collections::hash_map::Entry::Occupied(first) => {
                    repeated += 1;
                    if first.get() != example.question() {
                        differing.push(first.key().clone());
                    }
                }
            }
        }
    }
    if repeated > 0 {
        let rows = if repeated == 1 { "row" } else { "rows" };
        eprintln!("note: left out {repeated} {rows} whose data_source and id appeared before");
    }
    if let Some((source, id)) = differing.first() {
        let which = match (differing.len(), repeated) {
            (1, 1) => "it asks".to_string(),
            (1, _) => "1 of them asks".to_string(),
            (n, _) => format!("{n} of them ask"),
        };
        eprintln!(
            "note: {which} another question than the first row of its id (the first: data_source {source:?}, id {id:?}): give such rows ids of their own to evaluate them"
        );
    }
    if selected.is_empty() {
        bail!("the data files hold no questions");
    }
    Ok(selected)
}

fn progress_bar(total: usize, done: usize, mode: Mode) -> ProgressBar {
    let bar = ProgressBar::new(total as u64).with_position(done as u64);
    if let Ok(style) = ProgressStyle::with_template(
        "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} (eta {eta}) {msg}",
    ) {
        bar.set_style(style);
    }
    bar.set_prefix(format!("eval {}", mode.name()));
    bar
}

/// What this run did.
#[derive(Debug, Default)]
struct RunCounts {
    run: usize,
    failed: usize,
    first_error: Option<String>,
}

impl RunCounts {
    fn add(&mut self, row: &Row, progress: &ProgressBar) {
        self.run += 1;
        if row.failed {
            self.failed += 1;
            let error = row.error.as_deref().unwrap_or("no reason given");
            progress
                .suspend(|| eprintln!("warning: {} {} failed: {error}", row.data_source, row.id));
            self.first_error.get_or_insert_with(|| error.to_string());
        }
        progress.set_message(if self.failed > 0 {
            format!("{} failed", self.failed)
        } else {
            String::new()
        });
        progress.inc(1);
        if progress.is_hidden() {
            log_progress(progress, self.failed);
        }
    }
}

/// Where the progress bar is not drawn (stderr is not a terminal: a log file), a line at each
/// twentieth of the questions and at the last.
fn log_progress(progress: &ProgressBar, failed: usize) {
    let (done, total) = (progress.position(), progress.length().unwrap_or(0));
    let every = total.div_ceil(20).max(1);
    if done % every == 0 || done == total {
        eprintln!(
            "{}: {done}/{total} questions, {failed} failed this run, {:.0} s",
            progress.prefix(),
            progress.elapsed().as_secs_f64()
        );
    }
}

/// `agent` and `agent-only`: at most `batch_size` episodes in flight, beginning as the
/// admission says, each row written when its episode ends. Continuously, the questions go to
/// the episode loop a window of [`WINDOW_BATCHES`] batches at a time, so that the loop holds
/// that many trajectories at most, not the whole dataset's.
fn run_agent(
    args: &Args,
    todo: &[&Example],
    batch_size: usize,
    file: &mut PredictionsFile,
    progress: &ProgressBar,
) -> Result<RunCounts> {
    let (env, config): (Box<dyn Environment>, _) = match args.mode {
        Mode::AgentOnly => {
            let mut config = args
                .episode
                .config_with(&args.env, modes::agent_only_prompts())?;
            config.max_turns = 1;
            config.allow_calls = false;
            (Box::new(NoEnvironment), config)
        }
        _ => (
            Box::new(args.env.client("--mode agent")?),
            args.episode.config(&args.env)?,
        ),
    };
    args.agent.with_agent(|agent| {
        let mut writer = RowWriter {
            mode: args.mode,
            batch: &[],
            file,
            progress,
            counts: RunCounts::default(),
            error: None,
        };
        let (batches, admission): (Vec<&[&Example]>, _) = match args.admission {
            EvalAdmission::Batches => (todo.chunks(batch_size).collect(), Admission::Batches(batch_size)),
            EvalAdmission::Continuous => (todo.chunks(batch_size * WINDOW_BATCHES).collect(), Admission::Continuous(batch_size)),
        };
        for batch in batches {
            writer.batch = batch;
            let questions: Vec<&str> = batch.iter().map(|e| e.question()).collect();
            run_episodes_admitted(agent, env.as_ref(), &questions, &config, admission, &mut writer);
            if let Some(err) = writer.error.take() {
                return Err(err);
            }
        }
        Ok(writer.counts)
    })
}

/// Batches of questions per call of the episode loop under continuous admission: the places of
/// finished episodes are taken at once within a window, and only its last episodes wait for
/// each other.
const WINDOW_BATCHES: usize = 32;

/// When `eval`'s agent episodes begin (see [`Args::admission`]).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvalAdmission {
    Continuous,
    Batches,
}

/// Writes each episode's row as soon as the episode ends; once a row cannot be written, no
/// further episode begins.
struct RowWriter<'a> {
    mode: Mode,
    batch: &'a [&'a Example],
    file: &'a mut PredictionsFile,
    progress: &'a ProgressBar,
    counts: RunCounts,
    error: Option<anyhow::Error>,
}

impl EpisodeObserver for RowWriter<'_> {
    fn episode_finished(&mut self, episode: usize, trajectory: &Trajectory) {
        let Some(example) = self.batch.get(episode) else {
            return;
        };
        let row = modes::row_from_episode(example, self.mode, trajectory);
        match self.file.append(&row) {
            Ok(()) => self.counts.add(&row, self.progress),
            Err(err) => {
                self.error.get_or_insert(err);
            }
        }
    }

    fn admits_more(&self) -> bool {
        self.error.is_none()
    }
}

/// The environment of `agent-only`, which allows no calls: never reached.
struct NoEnvironment;

impl Environment for NoEnvironment {
    fn complete(&self, _messages: &[ChatMessage]) -> Result<String, EnvError> {
        Err(EnvError::Config(
            "agent-only mode has no large LLM".to_string(),
        ))
    }
}

/// `direct` and `cot`: the questions of a batch asked in parallel, rows written per batch.
fn run_llm(
    args: &Args,
    todo: &[&Example],
    batch_size: usize,
    file: &mut PredictionsFile,
    progress: &ProgressBar,
) -> Result<RunCounts> {
    let client = args.env.client(&format!("--mode {}", args.mode.name()))?;
    let runner = ParallelRunner::new(args.env.env_concurrency);
    let mut counts = RunCounts::default();
    for batch in todo.chunks(batch_size) {
        let rows = runner.map(batch, |_, example| {
            modes::ask_llm(&client, example, args.mode)
        });
        for row in rows {
            file.append(&row)?;
            counts.add(&row, progress);
        }
    }
    Ok(counts)
}
