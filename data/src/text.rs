//! Whole text files (JSONL and the like) read for the lines they hold.

use std::path::Path;

use crate::error::DataError;

/// The text of `path`; a file that is not UTF-8 is an error naming its first line that is not,
/// where `read_to_string` would only say that some line somewhere is not.
pub fn read_text(path: &Path) -> Result<String, DataError> {
    let bytes = std::fs::read(path).map_err(|source| DataError::Io { path: path.to_path_buf(), source })?;
    String::from_utf8(bytes).map_err(|err| {
        let valid = &err.as_bytes()[..err.utf8_error().valid_up_to()];
        let line = valid.iter().filter(|&&b| b == b'\n').count() + 1;
        DataError::NotUtf8 { path: path.to_path_buf(), line }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_line_that_is_not_utf8_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows.jsonl");
        std::fs::write(&path, b"{\"a\": 1}\n{\"b\": \"\xc3\xa9\"}\n{\"c\": \"\xff\"}\n\xfe\n").unwrap();
        let err = read_text(&path).unwrap_err();
        assert!(matches!(err, DataError::NotUtf8 { line: 3, .. }), "{err}");
        assert!(err.to_string().contains("rows.jsonl") && err.to_string().contains("line 3"), "{err}");
        std::fs::write(&path, "{\"b\": \"é\"}\n").unwrap();
        assert_eq!(read_text(&path).unwrap(), "{\"b\": \"é\"}\n");
        assert!(matches!(read_text(&dir.path().join("absent")), Err(DataError::Io { .. })));
    }
}
