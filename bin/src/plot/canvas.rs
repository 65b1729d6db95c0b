//! An RGB pixel buffer with the few drawing primitives the charts need: rectangles, lines,
//! markers and bitmap text; encoded to PNG with the pure-Rust `png` crate.

use super::font::{self, ADVANCE, CELL_H, GLYPH_W};

/// A colour as red, green, blue.
pub type Rgb = [u8; 3];

/// An axis-aligned rectangle in pixels: top-left corner and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rect {
    pub x: i32,
    pub y: i32,
    pub w: i32,
    pub h: i32,
}

impl Rect {
    pub fn new(x: i32, y: i32, w: i32, h: i32) -> Self {
        Self { x, y, w, h }
    }

    /// One past the last column.
    pub fn right(&self) -> i32 {
        self.x + self.w
    }

    /// One past the last row.
    pub fn bottom(&self) -> i32 {
        self.y + self.h
    }

    pub fn contains(&self, x: i32, y: i32) -> bool {
        x >= self.x && x < self.right() && y >= self.y && y < self.bottom()
    }

    /// The overlap of two rectangles (possibly empty: zero width or height).
    pub fn intersect(&self, other: &Rect) -> Rect {
        let x = self.x.max(other.x);
        let y = self.y.max(other.y);
        let r = self.right().min(other.right());
        let b = self.bottom().min(other.bottom());
        Rect::new(x, y, (r - x).max(0), (b - y).max(0))
    }
}

/// An RGB image being drawn on. Drawing outside the image (or outside the clip rectangle,
/// when one is set) is silently dropped.
#[derive(Debug, Clone)]
pub struct Canvas {
    width: u32,
    height: u32,
    pixels: Vec<u8>,
    clip: Option<Rect>,
}

impl Canvas {
    /// A `width`×`height` canvas filled with `background`.
    pub fn new(width: u32, height: u32, background: Rgb) -> Self {
        let n = width as usize * height as usize;
        let mut pixels = Vec::with_capacity(n * 3);
        for _ in 0..n {
            pixels.extend_from_slice(&background);
        }
        Self {
            width,
            height,
            pixels,
            clip: None,
        }
    }

    #[allow(dead_code)] // read back by tests
    pub fn width(&self) -> u32 {
        self.width
    }

    #[allow(dead_code)] // read back by tests
    pub fn height(&self) -> u32 {
        self.height
    }

    /// The raw pixels, row-major RGB.
    #[allow(dead_code)] // read back by tests
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }

    /// Restricts drawing to `clip` (or lifts the restriction with `None`).
    pub fn set_clip(&mut self, clip: Option<Rect>) {
        self.clip = clip;
    }

    fn bounds(&self) -> Rect {
        let all = Rect::new(0, 0, self.width as i32, self.height as i32);
        match &self.clip {
            Some(c) => all.intersect(c),
            None => all,
        }
    }

    /// The colour at (x, y); `None` outside the image.
    #[allow(dead_code)] // read back by tests
    pub fn get(&self, x: i32, y: i32) -> Option<Rgb> {
        if x < 0 || y < 0 || x >= self.width as i32 || y >= self.height as i32 {
            return None;
        }
        let i = (y as usize * self.width as usize + x as usize) * 3;
        Some([self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]])
    }

    /// Sets one pixel (dropped outside the image or clip rectangle).
    pub fn set(&mut self, x: i32, y: i32, color: Rgb) {
        if !self.bounds().contains(x, y) {
            return;
        }
        let i = (y as usize * self.width as usize + x as usize) * 3;
        self.pixels[i..i + 3].copy_from_slice(&color);
    }

    /// Fills a rectangle.
    pub fn fill_rect(&mut self, rect: Rect, color: Rgb) {
        let r = rect.intersect(&self.bounds());
        for y in r.y..r.bottom() {
            for x in r.x..r.right() {
                self.set(x, y, color);
            }
        }
    }

    /// Draws a rectangle's 1-pixel outline, inside `rect`.
    pub fn stroke_rect(&mut self, rect: Rect, color: Rgb) {
        if rect.w <= 0 || rect.h <= 0 {
            return;
        }
        let (r, b) = (rect.right() - 1, rect.bottom() - 1);
        self.line(rect.x, rect.y, r, rect.y, color);
        self.line(rect.x, b, r, b, color);
        self.line(rect.x, rect.y, rect.x, b, color);
        self.line(r, rect.y, r, b, color);
    }

    /// A 1-pixel line from (x0, y0) to (x1, y1), both ends included (Bresenham).
    pub fn line(&mut self, x0: i32, y0: i32, x1: i32, y1: i32, color: Rgb) {
        self.brush_line(x0, y0, x1, y1, 1, color);
    }

    /// A line `width` pixels thick (a square brush dragged along the Bresenham path).
    pub fn thick_line(&mut self, x0: i32, y0: i32, x1: i32, y1: i32, width: i32, color: Rgb) {
        self.brush_line(x0, y0, x1, y1, width.max(1), color);
    }

    fn brush_line(&mut self, x0: i32, y0: i32, x1: i32, y1: i32, width: i32, color: Rgb) {
        // Far-off endpoints (a wild value mapped to pixels) would make the walk very long;
        // nothing outside a generous margin can be visible anyway.
        let limit = 4 * (self.width.max(self.height) as i64 + 16);
        if [x0, y0, x1, y1].iter().any(|v| (*v as i64).abs() > limit) {
            return;
        }
        let off = (width - 1) / 2;
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            if width == 1 {
                self.set(x, y, color);
            } else {
                self.fill_rect(Rect::new(x - off, y - off, width, width), color);
            }
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// A horizontal dotted line (every other `gap` pixels), for grid lines.
    pub fn dotted_hline(&mut self, x0: i32, x1: i32, y: i32, gap: i32, color: Rgb) {
        let step = gap.max(1) * 2;
        let mut x = x0.min(x1);
        while x <= x0.max(x1) {
            for k in 0..gap.max(1) {
                if x + k <= x0.max(x1) {
                    self.set(x + k, y, color);
                }
            }
            x += step;
        }
    }

    /// A vertical dotted line, for grid lines.
    pub fn dotted_vline(&mut self, x: i32, y0: i32, y1: i32, gap: i32, color: Rgb) {
        let step = gap.max(1) * 2;
        let mut y = y0.min(y1);
        while y <= y0.max(y1) {
            for k in 0..gap.max(1) {
                if y + k <= y0.max(y1) {
                    self.set(x, y + k, color);
                }
            }
            y += step;
        }
    }

    /// A filled square marker of side `2 * radius + 1` centred on (x, y).
    pub fn marker(&mut self, x: i32, y: i32, radius: i32, color: Rgb) {
        let r = radius.max(0);
        self.fill_rect(Rect::new(x - r, y - r, 2 * r + 1, 2 * r + 1), color);
    }

    /// Width in pixels of `text` drawn at `scale` (no trailing gap).
    pub fn text_width(text: &str, scale: i32) -> i32 {
        let n = text.chars().count() as i32;
        if n == 0 {
            0
        } else {
            (n * ADVANCE - 1) * scale
        }
    }

    /// Height in pixels of a line of text at `scale` (ascender to descender).
    pub fn text_height(scale: i32) -> i32 {
        CELL_H * scale
    }

    /// Draws `text` with its cell's top-left corner at (x, y), each font pixel a
    /// `scale`×`scale` block; returns the box it occupies.
    pub fn text(&mut self, x: i32, y: i32, text: &str, color: Rgb, scale: i32) -> Rect {
        let s = scale.max(1);
        let mut cx = x;
        for c in text.chars() {
            let g = font::glyph_or_placeholder(c);
            for gy in 0..CELL_H {
                for gx in 0..GLYPH_W {
                    if g.ink(gx, gy) {
                        self.fill_rect(Rect::new(cx + gx * s, y + gy * s, s, s), color);
                    }
                }
            }
            cx += ADVANCE * s;
        }
        Rect::new(x, y, Self::text_width(text, s), Self::text_height(s))
    }

    /// Encodes the canvas as an 8-bit RGB PNG.
    pub fn to_png(&self) -> Result<Vec<u8>, png::EncodingError> {
        let mut out = Vec::new();
        {
            let mut encoder = png::Encoder::new(&mut out, self.width, self.height);
            encoder.set_color(png::ColorType::Rgb);
            encoder.set_depth(png::BitDepth::Eight);
            let mut writer = encoder.write_header()?;
            writer.write_image_data(&self.pixels)?;
            writer.finish()?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BG: Rgb = [255, 255, 255];
    const INK: Rgb = [0, 0, 0];

    fn inked(c: &Canvas) -> Vec<(i32, i32)> {
        let mut v = Vec::new();
        for y in 0..c.height() as i32 {
            for x in 0..c.width() as i32 {
                if c.get(x, y) != Some(BG) {
                    v.push((x, y));
                }
            }
        }
        v
    }

    #[test]
    fn diagonal_line_sets_exactly_the_diagonal() {
        let mut c = Canvas::new(12, 12, BG);
        c.line(0, 0, 9, 9, INK);
        let expected: Vec<(i32, i32)> = (0..10).map(|i| (i, i)).collect();
        assert_eq!(inked(&c), expected);
    }

    #[test]
    fn reversed_steep_and_flat_lines_are_continuous() {
        let mut c = Canvas::new(12, 12, BG);
        c.line(9, 0, 0, 9, INK);
        for i in 0..10 {
            assert_eq!(c.get(9 - i, i), Some(INK), "anti-diagonal at row {i}");
        }
        let mut c = Canvas::new(12, 12, BG);
        c.line(2, 0, 4, 10, INK);
        // A steep line touches every row exactly once.
        for y in 0..=10 {
            let n = (0..12).filter(|&x| c.get(x, y) == Some(INK)).count();
            assert_eq!(n, 1, "row {y}");
        }
        assert_eq!(c.get(2, 0), Some(INK));
        assert_eq!(c.get(4, 10), Some(INK));
        let mut c = Canvas::new(12, 12, BG);
        c.line(0, 5, 11, 5, INK);
        assert_eq!(inked(&c).len(), 12);
    }

    #[test]
    fn lines_and_rects_off_canvas_or_outside_clip_are_dropped() {
        let mut c = Canvas::new(10, 10, BG);
        c.line(-5, -5, 20, 20, INK);
        assert_eq!(inked(&c).len(), 10);
        let mut c = Canvas::new(10, 10, BG);
        c.set_clip(Some(Rect::new(2, 2, 3, 3)));
        c.fill_rect(Rect::new(0, 0, 10, 10), INK);
        assert_eq!(inked(&c).len(), 9);
        assert!(inked(&c)
            .iter()
            .all(|&(x, y)| (2..5).contains(&x) && (2..5).contains(&y)));
        // A wildly far endpoint is ignored rather than walked.
        let mut c = Canvas::new(10, 10, BG);
        c.line(0, 0, i32::MAX / 2, 3, INK);
        assert!(inked(&c).is_empty());
    }

    #[test]
    fn thick_line_and_marker_cover_their_width() {
        let mut c = Canvas::new(20, 20, BG);
        c.thick_line(2, 10, 17, 10, 3, INK);
        for x in 2..=17 {
            for y in 9..=11 {
                assert_eq!(c.get(x, y), Some(INK), "({x},{y})");
            }
        }
        assert_eq!(c.get(5, 8), Some(BG));
        let mut c = Canvas::new(20, 20, BG);
        c.marker(10, 10, 2, INK);
        assert_eq!(inked(&c).len(), 25);
    }

    #[test]
    fn stroke_rect_draws_only_the_outline() {
        let mut c = Canvas::new(10, 10, BG);
        c.stroke_rect(Rect::new(1, 1, 5, 4), INK);
        assert_eq!(inked(&c).len(), 2 * 5 + 2 * 2);
        assert_eq!(c.get(3, 2), Some(BG));
        assert_eq!(c.get(5, 4), Some(INK));
    }

    #[test]
    fn text_draws_inside_its_box_only() {
        let mut c = Canvas::new(120, 30, BG);
        let b = c.text(3, 4, "-0.5e+3%", INK, 2);
        assert_eq!(b, Rect::new(3, 4, Canvas::text_width("-0.5e+3%", 2), 18));
        let px = inked(&c);
        assert!(px.len() > 40, "only {} pixels", px.len());
        assert!(
            px.iter().all(|&(x, y)| b.contains(x, y)),
            "ink outside {b:?}"
        );
        // Ink reaches both ends of the box.
        assert!(px.iter().any(|&(x, _)| x <= b.x + 2));
        assert!(px.iter().any(|&(x, _)| x >= b.right() - 4));
        // Different strings draw differently.
        let mut d = Canvas::new(120, 30, BG);
        d.text(3, 4, "-0.5e+3/", INK, 2);
        assert_ne!(c.pixels(), d.pixels());
    }

    #[test]
    fn png_round_trips() {
        let mut c = Canvas::new(7, 5, BG);
        c.set(3, 2, [10, 20, 30]);
        let bytes = c.to_png().unwrap();
        let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (7, 5));
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(&buf[..info.buffer_size()], c.pixels());
    }
}
