//! Memory sizes as people write them: `80GiB`, `80 GB`, `24576MiB`, a bare number of bytes.

/// Parses a size: a number (decimals allowed) and an optional unit, `B`, `KB`/`MB`/`GB`/`TB`
/// (powers of 1000) or `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024), in any case; no unit means
/// bytes. The error says what was expected.
pub fn parse_size(text: &str) -> Result<u64, model::SettingError> {
    parse_with_unit(text).map(|(bytes, _)| bytes)
}

/// [`parse_size`], and whether the size was written with a unit.
fn parse_with_unit(text: &str) -> Result<(u64, bool), model::SettingError> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let bad = || format!("\"{text}\" is not a memory size (write e.g. 80GiB, 80GB or 24576MiB)");
    let value: f64 = number.parse().map_err(|_| bad())?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return Err(bad().into()),
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes < 1.0 {
        return Err(bad().into());
    }
    if bytes >= u64::MAX as f64 {
        return Err(format!("\"{text}\" is more bytes than any memory holds (at most 16 EiB)").into());
    }
    Ok((bytes.round() as u64, !unit.trim().is_empty()))
}

/// The least memory a device may be given as ([`parse_device_memory`]).
const LEAST_DEVICE_MEMORY: u64 = 64 << 20;

/// Parses a device's memory as [`parse_size`] does, refusing a number without its unit below
/// 64 MiB: that is a size whose unit was left out (`80` is 80 bytes), not a device.
pub fn parse_device_memory(text: &str) -> Result<u64, model::SettingError> {
    let (bytes, with_unit) = parse_with_unit(text)?;
    if !with_unit && bytes < LEAST_DEVICE_MEMORY {
        return Err(format!(
            "\"{text}\" is {bytes} bytes, too little for a device's memory: write its unit (e.g. 80GiB, 80GB or 24576MiB)"
        ).into());
    }
    Ok(bytes)
}

/// `bytes` in GiB with one decimal (MiB below 1 GiB, KiB below 1 MiB, bytes below 1 KiB), e.g.
/// `12.3 GiB`, `512 MiB`, `300 KiB`.
pub fn format_size(bytes: u64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    let mib = bytes as f64 / MIB;
    if bytes < 1024 {
        format!("{bytes} B")
    } else if bytes < 1 << 20 {
        format!("{:.0} KiB", bytes as f64 / 1024.0)
    } else if mib < 1024.0 {
        format!("{mib:.0} MiB")
    } else {
        format!("{:.1} GiB", mib / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_in_binary_and_decimal_units() {
        assert_eq!(parse_size("80GiB"), Ok(80 << 30));
        assert_eq!(parse_size(" 80 gib "), Ok(80 << 30));
        assert_eq!(parse_size("80GB"), Ok(80_000_000_000));
        assert_eq!(parse_size("24576MiB"), Ok(24 << 30));
        assert_eq!(parse_size("1.5TiB"), Ok(3 << 39));
        assert_eq!(parse_size("4096"), Ok(4096));
        for bad in ["", "GiB", "80 GiBs", "-1GB", "0", "1e3GB"] {
            let err = parse_size(bad).unwrap_err();
            assert!(err.0.contains("80GiB"), "{bad}: {err}");
        }
        let err = parse_size("99999999999999999999GiB").unwrap_err();
        assert!(err.0.contains("more bytes than any memory"), "{err}");
    }

    /// A device's memory written without its unit is refused, not planned as a few bytes.
    #[test]
    fn a_device_memory_without_its_unit_is_refused() {
        assert_eq!(parse_device_memory("80GiB"), Ok(80 << 30));
        assert_eq!(parse_device_memory("85899345920"), Ok(80 << 30));
        let err = parse_device_memory("80").unwrap_err();
        assert!(err.0.contains("80 bytes") && err.0.contains("80GiB"), "{err}");
        assert!(parse_device_memory("0").unwrap_err().0.contains("80GiB"));
        assert_eq!(parse_device_memory("1MiB"), Ok(1 << 20), "a small memory written with its unit is meant");
    }

    #[test]
    fn sizes_print_in_gib_or_mib() {
        assert_eq!(format_size(80 << 30), "80.0 GiB");
        assert_eq!(format_size(512 << 20), "512 MiB");
        assert_eq!(format_size((3 << 30) + (300 << 20)), "3.3 GiB");
        assert_eq!(format_size(300 << 10), "300 KiB");
        assert_eq!(format_size(1000), "1000 B");
    }
}
