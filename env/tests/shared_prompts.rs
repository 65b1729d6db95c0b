//! The bundled prompt texts are byte-identical to the reference texts in `../shared/prompts/`.

use std::path::PathBuf;

use prompt_r1_env::{REFERENCE_INSTRUCTION, REFERENCE_SYSTEM};

/// `<workspace root>/../shared`, or `None` (with the reason printed) outside CI.
fn shared_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared");
    if dir.is_dir() {
        return Some(dir);
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{} is missing, and CI=true requires it", dir.display());
    }
    eprintln!("skipping: {} not found", dir.display());
    None
}

#[test]
fn bundled_prompts_match_the_reference_texts() {
    let Some(shared) = shared_dir() else { return };
    let read = |name: &str| std::fs::read_to_string(shared.join("prompts").join(name)).unwrap();
    assert_eq!(REFERENCE_SYSTEM, read("system.txt"));
    assert_eq!(REFERENCE_INSTRUCTION, read("instruction.txt"));
}
