//! Of rows with the same key, the last counts: an eval that is resumed appends the questions it
//! runs again to `predictions.jsonl`, so a data source and example id can appear more than once.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;

/// The indices of the rows that a later row with the same key replaces; rows without a key
/// (`None`) are never replaced and replace nothing.
pub fn superseded_rows<K: Eq + Hash>(keys: impl IntoIterator<Item = Option<K>>) -> HashSet<usize> {
    let mut last: HashMap<K, usize> = HashMap::new();
    let mut superseded = HashSet::new();
    for (index, key) in keys.into_iter().enumerate() {
        if let Some(earlier) = key.and_then(|key| last.insert(key, index)) {
            superseded.insert(earlier);
        }
    }
    superseded
}

/// The key of a predictions row: its data source and its id as JSON text (a null id is no key).
pub fn prediction_key(data_source: &str, id: &serde_json::Value) -> Option<(String, String)> {
    (!id.is_null()).then(|| (data_source.to_owned(), id.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_the_last_row_of_a_key_is_kept() {
        let keys = [Some("a"), None, Some("b"), Some("a"), None, Some("a")];
        assert_eq!(superseded_rows(keys), [0, 3].into());
        assert!(superseded_rows(Vec::<Option<u8>>::new()).is_empty());
    }

    #[test]
    fn a_row_is_keyed_by_data_source_and_id() {
        assert_eq!(prediction_key("nq", &json!("7")), Some(("nq".into(), "\"7\"".into())));
        assert_ne!(prediction_key("nq", &json!(7)), prediction_key("nq", &json!("7")));
        assert_eq!(prediction_key("nq", &json!(null)), None);
    }
}
