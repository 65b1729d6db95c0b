//! Line charts laid out as a grid of panels: series drawn as lines or points on a left axis, an
//! optional right-hand axis, an optional shaded band, a legend, and "n/a" for a panel without
//! data.

use std::ops::Range;
use std::sync::OnceLock;

use anyhow::{anyhow, Result};
use plotters::chart::SeriesAnno;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

pub type Rgb = RGBColor;

pub const WHITE: Rgb = RGBColor(255, 255, 255);
pub const INK: Rgb = RGBColor(34, 34, 34);
pub const GRID: Rgb = RGBColor(225, 225, 225);
pub const MUTED: Rgb = RGBColor(150, 150, 150);
pub const BLUE: Rgb = RGBColor(31, 119, 180);
pub const ORANGE: Rgb = RGBColor(255, 127, 14);
pub const GREEN: Rgb = RGBColor(44, 160, 44);
pub const RED: Rgb = RGBColor(214, 39, 40);
pub const PURPLE: Rgb = RGBColor(148, 103, 189);
pub const BROWN: Rgb = RGBColor(140, 86, 75);
pub const LIGHT_BLUE: Rgb = RGBColor(198, 219, 239);

/// The family name the embedded font is registered under.
const FONT: &str = "prompt-r1-sans";
const FONT_BYTES: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans-Latin.ttf");

/// Registers the embedded font with plotters once per process.
fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(anyhow!(
            "the embedded plot font is not a valid TrueType font"
        ))
    }
}

/// How a series is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// Consecutive values joined by a line (an isolated value gets a marker).
    Line,
    /// A marker per value.
    Points,
}

/// One named series, aligned with the panel's x values; `None` or non-finite values are gaps.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub color: Rgb,
    pub style: Style,
    pub values: Vec<Option<f64>>,
}

impl Series {
    pub fn new(name: &str, color: Rgb, style: Style, values: Vec<Option<f64>>) -> Self {
        Self {
            name: name.into(),
            color,
            style,
            values,
        }
    }

    fn value(&self, i: usize) -> Option<f64> {
        finite(self.values.get(i).copied().flatten())
    }

    fn has_data(&self) -> bool {
        (0..self.values.len()).any(|i| self.value(i).is_some())
    }

    /// Runs of consecutive points with values, as (x, y) pairs.
    fn runs(&self, xs: &[f64]) -> Vec<Vec<(f64, f64)>> {
        let mut runs = vec![Vec::new()];
        for (i, &x) in xs.iter().enumerate() {
            match self.value(i) {
                Some(y) => runs.last_mut().expect("never empty").push((x, y)),
                None => runs.push(Vec::new()),
            }
        }
        runs.retain(|r| !r.is_empty());
        runs
    }
}

fn finite(v: Option<f64>) -> Option<f64> {
    v.filter(|v| v.is_finite())
}

/// A shaded region between two series (e.g. mean ± std), drawn under the lines.
#[derive(Debug, Clone)]
pub struct Band {
    pub name: String,
    pub color: Rgb,
    pub lo: Vec<Option<f64>>,
    pub hi: Vec<Option<f64>>,
}

impl Band {
    fn at(&self, i: usize) -> Option<(f64, f64)> {
        let lo = finite(self.lo.get(i).copied().flatten())?;
        let hi = finite(self.hi.get(i).copied().flatten())?;
        Some((lo, hi))
    }

    /// One closed outline (the high edge forwards, the low edge back) per run of steps.
    fn polygons(&self, xs: &[f64]) -> Vec<Vec<(f64, f64)>> {
        let mut runs: Vec<Vec<(f64, f64, f64)>> = vec![Vec::new()];
        for (i, &x) in xs.iter().enumerate() {
            match self.at(i) {
                Some((lo, hi)) => runs.last_mut().expect("never empty").push((x, lo, hi)),
                None => runs.push(Vec::new()),
            }
        }
        runs.into_iter()
            .filter(|r| !r.is_empty())
            .map(|run| {
                let upper = run.iter().map(|&(x, _, hi)| (x, hi));
                let lower = run.iter().rev().map(|&(x, lo, _)| (x, lo));
                upper.chain(lower).collect()
            })
            .collect()
    }
}

/// One chart: x values, series on the left axis, optionally series on a right axis (drawn
/// in their own scale, labelled in their colour) and a band on the left axis.
#[derive(Debug, Clone)]
pub struct Panel {
    pub title: String,
    pub xs: Vec<f64>,
    pub left: Vec<Series>,
    pub right: Vec<Series>,
    pub band: Option<Band>,
}

impl Panel {
    pub fn new(title: &str, xs: Vec<f64>) -> Self {
        Self {
            title: title.into(),
            xs,
            left: Vec::new(),
            right: Vec::new(),
            band: None,
        }
    }

    pub fn left(mut self, series: Series) -> Self {
        self.left.push(series);
        self
    }

    pub fn right(mut self, series: Series) -> Self {
        self.right.push(series);
        self
    }

    pub fn band(mut self, band: Band) -> Self {
        self.band = Some(band);
        self
    }

    /// Whether any series has a finite value (otherwise the panel says "n/a").
    pub fn has_data(&self) -> bool {
        self.left.iter().chain(&self.right).any(Series::has_data)
    }

    fn y_range(series: &[Series], band: Option<&Band>) -> Option<Range<f64>> {
        let values = series
            .iter()
            .flat_map(|s| (0..s.values.len()).filter_map(move |i| s.value(i)));
        let band_values = band
            .into_iter()
            .flat_map(|b| (0..b.lo.len().max(b.hi.len())).filter_map(move |i| b.at(i)))
            .flat_map(|(lo, hi)| [lo, hi]);
        padded(values.chain(band_values), 0.05)
    }
}

/// The range of `values` widened by `margin` of its span on each side (a single value gets a
/// tenth of itself each side), or `None` without finite values.
fn padded(values: impl Iterator<Item = f64>, margin: f64) -> Option<Range<f64>> {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold(None, |acc, v| match acc {
            None => Some((v, v)),
            Some((lo, hi)) => Some((f64::min(lo, v), f64::max(hi, v))),
        })?;
    let span = hi - lo;
    if span > 0.0 {
        Some(lo - margin * span..hi + margin * span)
    } else {
        // A tenth of the value each side, whatever its size (a constant learning rate of 1e-5
        // must not sit on a unit-wide axis as "0"); zero gets a unit-wide range.
        let half = if lo == 0.0 { 0.5 } else { lo.abs() * 0.1 };
        Some(lo - half..hi + half)
    }
}

/// A tick label: as few digits as tell neighbouring ticks apart.
fn tick_label(v: f64, span: f64) -> String {
    if v.abs() < span * 1e-9 {
        return "0".into();
    }
    let magnitude = v.abs().max(span);
    if !(1e-3..1e5).contains(&magnitude) {
        return format!("{v:.1e}");
    }
    let decimals = (2.0 - span.log10().floor()).clamp(0.0, 6.0) as usize;
    let text = format!("{v:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        text
    }
}

/// A whole figure: a title line and panels in a grid of `cols` columns.
pub struct Figure {
    pub title: String,
    pub cols: usize,
    pub panels: Vec<Panel>,
}

impl Figure {
    /// Draws the figure on a `width`×`height` white image and encodes it as PNG.
    pub fn render_png(&self, width: u32, height: u32) -> Result<Vec<u8>> {
        let pixels = self.render(width, height)?;
        let mut png = Vec::new();
        let mut encoder = png::Encoder::new(&mut png, width, height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(&pixels)?;
        writer.finish()?;
        Ok(png)
    }

    /// Draws the figure as RGB bytes, row by row.
    pub fn render(&self, width: u32, height: u32) -> Result<Vec<u8>> {
        register_font()?;
        let mut pixels = vec![255u8; width as usize * height as usize * 3];
        {
            let root = BitMapBackend::with_buffer(&mut pixels, (width, height)).into_drawing_area();
            root.fill(&WHITE).map_err(draw_error)?;
            let cols = self.cols.max(1);
            let rows = self.panels.len().div_ceil(cols).max(1);
            let cell_h = height / rows as u32;
            let text = (cell_h / 22).clamp(10, 20);
            let body = if self.title.is_empty() {
                root
            } else {
                let header = (text * 2).min(height / 4);
                let (top, body) = root.split_vertically(header);
                let font = (FONT, text as f64 * 1.3).into_font().color(&INK);
                let style = font.pos(Pos::new(HPos::Left, VPos::Center));
                top.draw_text(&self.title, &style, (12, header as i32 / 2))
                    .map_err(draw_error)?;
                body
            };
            for (area, panel) in body.split_evenly((rows, cols)).iter().zip(&self.panels) {
                draw_panel(area, panel, text).map_err(draw_error)?;
            }
            body.present().map_err(draw_error)?;
        }
        Ok(pixels)
    }
}

fn draw_error<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> anyhow::Error {
    anyhow!("cannot draw the chart: {e}")
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;
type DrawResult<'a> =
    Result<(), DrawingAreaErrorKind<<BitMapBackend<'a> as DrawingBackend>::ErrorType>>;

fn draw_panel<'a>(area: &Area<'a>, panel: &Panel, text: u32) -> DrawResult<'a> {
    let label = (FONT, text as f64).into_font();
    let title = (FONT, text as f64 * 1.15).into_font().color(&INK);
    let x_range = padded(panel.xs.iter().copied(), 0.02);
    let left_range = Panel::y_range(&panel.left, panel.band.as_ref());
    let right_range = Panel::y_range(&panel.right, None);
    let (Some(x_range), true) = (x_range, panel.has_data()) else {
        return draw_empty(area, panel, text);
    };
    let left_range = left_range.unwrap_or(0.0..1.0);
    let margin = text as i32 / 2 + 4;
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, title)
        .margin(margin)
        .x_label_area_size(text * 2)
        .y_label_area_size(text * 4)
        .right_y_label_area_size(if right_range.is_some() { text * 4 } else { 0 })
        .build_cartesian_2d(x_range.clone(), left_range.clone())?;
    let x_span = x_range.end - x_range.start;
    let y_span = left_range.end - left_range.start;
    let left_color = if right_range.is_some() {
        panel.left[0].color
    } else {
        INK
    };
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .bold_line_style(GRID)
        .axis_style(MUTED)
        .x_labels(6)
        .y_labels(6)
        .label_style(label.clone())
        .y_label_style(label.clone().color(&left_color))
        .x_label_formatter(&|v| tick_label(*v, x_span))
        .y_label_formatter(&|v| tick_label(*v, y_span))
        .draw()?;
    let marker = (text / 4).max(2);
    let mut entries = 0;
    if let Some(band) = &panel.band {
        let color = band.color;
        let outlines = band.polygons(&panel.xs);
        chart
            .draw_series(
                outlines
                    .into_iter()
                    .map(|o| Polygon::new(o, color.filled())),
            )?
            .label(band.name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
        entries += 1;
    }
    for series in panel.left.iter().filter(|s| s.has_data()) {
        let (paths, dots) = shapes(panel, series);
        let color = series.color;
        let lines = chart.draw_series(
            paths
                .into_iter()
                .map(|p| PathElement::new(p, color.stroke_width(2))),
        )?;
        if series.style == Style::Line {
            legend_line(lines, series);
        }
        let points = chart.draw_series(
            dots.into_iter()
                .map(|p| Circle::new(p, marker, color.filled())),
        )?;
        if series.style == Style::Points {
            legend_point(points, series, marker);
        }
        entries += 1;
    }
    let corner = quietest_corner(panel, &left_range, right_range.as_ref());
    let Some(right_range) = right_range else {
        if entries > 1 {
            chart
                .configure_series_labels()
                .position(corner)
                .label_font(label)
                .border_style(GRID)
                .background_style(WHITE.mix(0.85))
                .draw()?;
        }
        return Ok(());
    };
    // plotters' primary mesh labels every y label area: blank the right one for the right axis.
    let (w, h) = area.dim_in_pixel();
    let right_labels = [
        (w as i32 - margin - 4 * text as i32, 0),
        (w as i32, h as i32),
    ];
    area.draw(&Rectangle::new(right_labels, WHITE.filled()))?;
    let right_span = right_range.end - right_range.start;
    let color = panel.right[0].color;
    let mut chart = chart.set_secondary_coord(x_range, right_range);
    chart
        .configure_secondary_axes()
        .axis_style(MUTED)
        .y_labels(6)
        .label_style(label.clone().color(&color))
        .y_label_formatter(&|v| tick_label(*v, right_span))
        .draw()?;
    for series in panel.right.iter().filter(|s| s.has_data()) {
        let (paths, dots) = shapes(panel, series);
        let color = series.color;
        let lines = chart.draw_secondary_series(
            paths
                .into_iter()
                .map(|p| PathElement::new(p, color.stroke_width(2))),
        )?;
        if series.style == Style::Line {
            legend_line(lines, series);
        }
        let points = chart.draw_secondary_series(
            dots.into_iter()
                .map(|p| Circle::new(p, marker, color.filled())),
        )?;
        if series.style == Style::Points {
            legend_point(points, series, marker);
        }
    }
    chart
        .configure_series_labels()
        .position(corner)
        .label_font(label)
        .border_style(GRID)
        .background_style(WHITE.mix(0.85))
        .draw()?;
    Ok(())
}

/// The corner of the plot with the fewest data points near it, where the legend hides least.
fn quietest_corner(
    panel: &Panel,
    left: &Range<f64>,
    right: Option<&Range<f64>>,
) -> SeriesLabelPosition {
    let (Some(x0), Some(x1)) = (panel.xs.first(), panel.xs.last()) else {
        return SeriesLabelPosition::UpperRight;
    };
    let unit = |v: f64, r: &Range<f64>| (v - r.start) / (r.end - r.start);
    let x_span = (x0.min(*x1)..x0.max(*x1) + f64::EPSILON).clone();
    let on = |series: &[Series], range: &Range<f64>| -> Vec<(f64, f64)> {
        series
            .iter()
            .flat_map(|s| s.runs(&panel.xs))
            .flatten()
            .map(|(x, y)| (unit(x, &x_span), unit(y, range)))
            .collect()
    };
    let mut points = on(&panel.left, left);
    if let Some(right) = right {
        points.extend(on(&panel.right, right));
    }
    let corners = [
        (SeriesLabelPosition::UpperRight, 0.55, 0.55),
        (SeriesLabelPosition::UpperLeft, 0.0, 0.55),
        (SeriesLabelPosition::LowerRight, 0.55, 0.0),
        (SeriesLabelPosition::LowerLeft, 0.0, 0.0),
    ];
    let crowd = |&(_, x, y): &(SeriesLabelPosition, f64, f64)| {
        points
            .iter()
            .filter(|p| (x..x + 0.45).contains(&p.0) && (y..y + 0.45).contains(&p.1))
            .count()
    };
    corners
        .iter()
        .min_by_key(|c| crowd(c))
        .map(|c| c.0.clone())
        .unwrap_or(SeriesLabelPosition::UpperRight)
}

/// A series as paths (runs of two or more values, when drawn as a line) and single points
/// (every value when drawn as points; an isolated value of a line).
type Shapes = (Vec<Vec<(f64, f64)>>, Vec<(f64, f64)>);

fn shapes(panel: &Panel, series: &Series) -> Shapes {
    let (mut paths, mut dots) = (Vec::new(), Vec::new());
    for run in series.runs(&panel.xs) {
        if series.style == Style::Line && run.len() > 1 {
            paths.push(run);
        } else {
            dots.extend(run);
        }
    }
    (paths, dots)
}

fn legend_line<DB: DrawingBackend>(anno: &mut SeriesAnno<'_, DB>, series: &Series) {
    let color = series.color;
    anno.label(series.name.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], color.stroke_width(2)));
}

fn legend_point<DB: DrawingBackend>(anno: &mut SeriesAnno<'_, DB>, series: &Series, marker: u32) {
    let color = series.color;
    anno.label(series.name.as_str())
        .legend(move |(x, y)| Circle::new((x + 7, y), marker, color.filled()));
}

/// A panel without data: its title and a framed "n/a".
fn draw_empty<'a>(area: &Area<'a>, panel: &Panel, text: u32) -> DrawResult<'a> {
    let (w, h) = area.dim_in_pixel();
    let margin = text as i32 / 2 + 4;
    let title = (FONT, text as f64 * 1.15)
        .into_font()
        .color(&INK)
        .pos(Pos::new(HPos::Center, VPos::Top));
    area.draw_text(&panel.title, &title, (w as i32 / 2, margin))?;
    let top = margin + 2 * text as i32;
    let frame = [
        (margin + 4 * text as i32, top),
        (w as i32 - margin, h as i32 - margin - 2 * text as i32),
    ];
    area.draw(&Rectangle::new(frame, MUTED))?;
    let na = (FONT, text as f64 * 2.0)
        .into_font()
        .color(&MUTED)
        .pos(Pos::new(HPos::Center, VPos::Center));
    let centre = ((frame[0].0 + frame[1].0) / 2, (frame[0].1 + frame[1].1) / 2);
    area.draw_text("n/a", &na, centre)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pixels of exactly `color` within columns `x0..x1` and rows `y0..y1` of an RGB image.
    fn count(
        pixels: &[u8],
        width: u32,
        (x0, x1): (u32, u32),
        (y0, y1): (u32, u32),
        color: Rgb,
    ) -> usize {
        let mut n = 0;
        for y in y0..y1 {
            for x in x0..x1 {
                let i = 3 * (y * width + x) as usize;
                n += (pixels[i..i + 3] == [color.0, color.1, color.2]) as usize;
            }
        }
        n
    }

    #[test]
    fn panels_draw_their_series_or_say_n_a() {
        let xs: Vec<f64> = (1..=10).map(f64::from).collect();
        let rising = Series::new(
            "a",
            BLUE,
            Style::Line,
            xs.iter().map(|&x| Some(x * x)).collect(),
        );
        let empty = Series::new("b", ORANGE, Style::Line, vec![None; 10]);
        let fig = Figure {
            title: "test".into(),
            cols: 2,
            panels: vec![
                Panel::new("with data", xs.clone()).left(rising),
                Panel::new("nothing", xs.clone()).left(empty),
            ],
        };
        let pixels = fig.render(900, 400).unwrap();
        assert_eq!(pixels.len(), 900 * 400 * 3);
        assert!(
            count(&pixels, 900, (0, 450), (0, 400), BLUE) > 200,
            "line drawn"
        );
        assert_eq!(count(&pixels, 900, (450, 900), (0, 400), BLUE), 0);
        assert_eq!(
            count(&pixels, 900, (450, 900), (0, 400), ORANGE),
            0,
            "no data, no line"
        );
        // The frame and "n/a" of the empty panel, in muted grey.
        assert!(count(&pixels, 900, (450, 900), (40, 400), MUTED) > 300);
    }

    #[test]
    fn the_line_rises_left_to_right_in_pixels() {
        let xs: Vec<f64> = (0..5).map(f64::from).collect();
        let s = Series::new("a", RED, Style::Line, xs.iter().map(|&x| Some(x)).collect());
        let fig = Figure {
            title: String::new(),
            cols: 1,
            panels: vec![Panel::new("t", xs).left(s)],
        };
        let pixels = fig.render(500, 300).unwrap();
        let red: Vec<(u32, u32)> = (0..300)
            .flat_map(|y| (0..500).map(move |x| (x, y)))
            .filter(|&(x, y)| count(&pixels, 500, (x, x + 1), (y, y + 1), RED) == 1)
            .collect();
        let leftmost = red.iter().min_by_key(|p| p.0).unwrap();
        let rightmost = red.iter().max_by_key(|p| p.0).unwrap();
        assert!(leftmost.1 > rightmost.1 + 100, "{leftmost:?} {rightmost:?}");
    }

    #[test]
    fn nan_and_missing_values_leave_gaps() {
        let xs: Vec<f64> = (0..5).map(f64::from).collect();
        let s = Series::new(
            "a",
            RED,
            Style::Line,
            vec![Some(f64::NAN), None, Some(f64::INFINITY)],
        );
        assert!(!Panel::new("t", xs.clone()).left(s).has_data());
        let s = Series::new(
            "a",
            RED,
            Style::Line,
            vec![Some(1.0), Some(2.0), None, Some(3.0), Some(f64::NAN)],
        );
        assert_eq!(
            s.runs(&xs),
            vec![vec![(0.0, 1.0), (1.0, 2.0)], vec![(3.0, 3.0)]]
        );
        let band = Band {
            name: "b".into(),
            color: LIGHT_BLUE,
            lo: vec![Some(0.0), Some(1.0), None],
            hi: vec![Some(2.0), Some(3.0), Some(4.0)],
        };
        assert_eq!(
            band.polygons(&xs),
            vec![vec![(0.0, 2.0), (1.0, 3.0), (1.0, 1.0), (0.0, 0.0)]]
        );
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(tick_label(0.2, 1.0), "0.2");
        assert_eq!(tick_label(1.0, 2.0), "1");
        assert_eq!(tick_label(-0.005, 0.02), "-0.005");
        assert_eq!(tick_label(40.0, 100.0), "40");
        assert_eq!(tick_label(1e-17, 0.1), "0");
        assert_eq!(tick_label(0.0002, 0.0004), "2.0e-4");
        assert_eq!(tick_label(150000.0, 250000.0), "1.5e5");
    }

    #[test]
    fn a_single_value_gets_a_range_around_it() {
        let r = padded([7.0].into_iter(), 0.05).unwrap();
        assert!(r.start < 7.0 && r.end > 7.0, "{r:?}");
        for value in [3e-3, 1e-5, -2e-6, 0.0] {
            let r = padded([value, value].into_iter(), 0.05).unwrap();
            let span = r.end - r.start;
            assert!(r.start < value && r.end > value, "{value}: {r:?}");
            assert!(value == 0.0 || span <= value.abs(), "{value}: {r:?}");
            let (low, high) = (tick_label(r.start, span), tick_label(r.end, span));
            assert!(low != high && low != "0" && high != "0", "{value}: {low} {high}");
        }
        assert!(padded([f64::NAN].into_iter(), 0.05).is_none());
    }
}
